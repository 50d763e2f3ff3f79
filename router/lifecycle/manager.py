"""The model lifecycle: pull, start, stop, delete and patch the registry's models, and find the running
model a request names.

The registry (router/lifecycle/registry.py) holds the states; the launcher's model host fetches files
and runs shard groups; each running model is a ServedModel with its own scheduler. Start and stop
run as tasks of their own, so a client that hangs up mid-way never leaves a model half started.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from router.errors import (InvalidModelIdError, ModelHostMissingError, ModelNotFoundError,
                           ModelStartError, ModelStateError, OverloadedError, RouterError,
                           UnknownAdapterError, ValidationError)
from router.lifecycle.adapters import AdapterEntry
from router.lifecycle.model_host import ModelHostClient, ModelHostError
from router.lifecycle.registry import (BUSY, DOWNLOADED, DOWNLOADING, NOT_DOWNLOADED, RUNNING,
                                       SERVABLE, STARTING, STOPPED, STOPPING, ModelRecord,
                                       ModelRegistry, check_model_id, directory_for,
                                       parameter_count)
from router.lifecycle.served_model import ServedModel, build_served, model_config
from router.lifecycle.settings import (ENGINE_PARAMETERS, PARAMETERS, SETTINGS, ChatPrompt,
                                       check_keys, checked)

log = logging.getLogger("tgi.router")

# the TGI routes name no model; OpenAI clients of TGI send any name, often "tgi"
UNNAMED_MODELS = (None, "", "tgi")  # names that mean "the model", whatever its id
DRAIN_TIMEOUT_S = 60.0  # how long a stop waits for the model's requests in flight
LOST_GROUP_CHECK_S = 2.0  # how often models whose shards are lost are asked about
MAX_PULLS = 4  # pulls at once: each holds one of the model host's workers (launcher/model_host.py)


class ModelManager:
    def __init__(self, config, registry: ModelRegistry, host: ModelHostClient | None, *,
                 supervise: Callable, default_dtype: str = "",
                 default_device: str = "auto"):
        self.config = config
        self.registry = registry
        self.host = host
        self.supervise = supervise  # wraps each model's batching loop
        self.default_dtype = default_dtype
        self.default_device = default_device
        self.served: dict[str, ServedModel] = {}
        self.default_id: str | None = None
        self._moves: dict[str, asyncio.Task] = {}  # a start or stop under way, by model id
        self._pulls: set[asyncio.Task] = set()
        self._adapter_fetches: dict[str, asyncio.Lock] = {}  # by cache directory name
        self._closing = False

    def _check_host(self) -> None:
        if self.registry.unavailable is not None:
            raise ModelHostMissingError(self.registry.unavailable)
        if self.host is None or self.registry.models_dir is None:
            raise ModelHostMissingError()

    # ---- serving ---------------------------------------------------------------------------

    def add_default(self, served: ServedModel) -> None:
        """The launcher's --model-id: the default, running from the start. Recorded in the
        registry when its name is a valid id (a path given as --model-id is served unrecorded)."""
        model_id = served.model_name
        self.default_id = model_id
        self._serve(model_id, served)
        try:
            check_model_id(model_id)
        except RouterError:
            return
        record = self.registry.records.get(model_id)
        if record is None or record.model_dir != served.config.tokenizer_path:
            record = ModelRecord(model_id, RUNNING, model_dir=served.config.tokenizer_path,
                                 source=served.config.tokenizer_path, owned=False)
            record.size_bytes = _size(Path(served.config.tokenizer_path))
            record.parameter_count = parameter_count(served.config.tokenizer_path)
        record.state, record.error = RUNNING, None
        record.settings = {**record.settings, "num_shard": served.shard_info.world_size,
                           "dtype": served.shard_info.dtype}
        self._apply(record, served)
        self.registry.add(record)

    def _serve(self, model_id: str, served: ServedModel) -> None:
        """`served` answers under `model_id`; its adapters may come from the Hub through the
        model host, and take no name another model or adapter has."""
        self.served[model_id] = served
        adapters = served.adapters
        if self.host is not None and self.registry.directory is not None:
            adapters.fetch = self._fetch_adapter
        adapters.name_taken = lambda name: self._name_use(name, served)

    def served_model(self, name: str | None) -> ServedModel:
        """The running model a request names: 404 when no model has that name, 409 when it is
        not running. While one model runs, a name nobody knows is that model, as TGI ignores
        the name (models merely on disk do not change how a one-model server answers)."""
        if name in self.served:
            return self.served[name]
        if name not in UNNAMED_MODELS and name in self.registry.records:
            state = self.registry.records[name].state
            advice = (f"pull it with POST /v1/models/pull, then start it with PUT "
                      f"/v1/models/{name}/start" if state == NOT_DOWNLOADED
                      else f"start it with PUT /v1/models/{name}/start")
            raise ModelStateError(f"model {name!r} is {state}, not running: {advice}", state)
        if name not in UNNAMED_MODELS and len(self.served) > 1:
            raise ModelNotFoundError(f"model {str(name)[:200]!r} not found: GET /v1/models lists "
                                     "the models this server knows")
        if self.default_id in self.served:
            return self.served[self.default_id]
        if len(self.served) == 1:  # the default is stopped: the one model that runs answers
            return next(iter(self.served.values()))
        if self.default_id is None or self.default_id not in self.registry.records:
            raise ModelNotFoundError("no default model: name one with `model` or the X-Model-Id "
                                     "header")
        state = self.registry.records[self.default_id].state
        raise ModelStateError(f"the default model {self.default_id!r} is {state}, not running",
                              state)

    @property
    def default(self) -> ServedModel | None:
        return self.served.get(self.default_id)

    # ---- LoRA adapters ---------------------------------------------------------------------

    def adapter_model(self, name: str | None) -> tuple[ServedModel, str] | None:
        """The running model that has a LoRA adapter named `name` (loaded, or being unloaded:
        its requests then hear that it is not loaded), and the name; None when none has."""
        if not isinstance(name, str) or not name:
            return None
        for served in self.served.values():
            if name in served.adapters.names():
                return served, name
        return None

    def adapter_names(self) -> list[str]:
        return sorted(n for served in self.served.values() for n in served.adapters.names())

    async def load_adapter(self, name: str, source: str, *,
                           model: str | None = None) -> tuple[ServedModel, AdapterEntry]:
        """Loads an adapter into `model` (the default model, or the one running model, when
        None; 404/409 as served_model answers)."""
        served = self.served_model(model)
        return served, await served.adapters.load(name, source)

    async def unload_adapter(self, name: str) -> ServedModel:
        """Unloads adapter `name` from the model that has it; UnknownAdapterError if none."""
        found = self.adapter_model(name)
        if found is None:
            raise UnknownAdapterError(name, self.adapter_names())
        await found[0].adapters.unload(name)
        return found[0]

    def _name_use(self, name: str, loading_into: ServedModel) -> str | None:
        """What else `name` names, if anything: a model, or another model's adapter."""
        if name in self.served or name in self.registry.records:
            return "the id of a model"
        for model_id, served in self.served.items():
            if served is not loading_into and served.adapters.has(name):
                return f"an adapter of model {model_id!r}"
        return None

    def _check_not_adapter(self, model_id: str) -> None:
        found = self.adapter_model(model_id)
        if found is not None:
            raise InvalidModelIdError(f"{model_id!r} is the name of a LoRA adapter of model "
                                      f"{found[0].model_name!r}: models and adapters share the "
                                      "names a request's `model` gives; pick another id")

    async def _fetch_adapter(self, hub_id: str, revision: str | None) -> str:
        """A Hub adapter's directory in the cache (<registry>/adapters/<org%2Fname[@rev]>),
        fetched by the launcher the first time."""
        name = hub_id.replace("/", "%2F") + (f"@{revision.replace('/', '%2F')}" if revision
                                             else "")
        target = self.registry.directory / "adapters" / name
        # two loads of one Hub id under two names: the second waits for the first's pull
        async with self._adapter_fetches.setdefault(name, asyncio.Lock()):
            if not (target / "adapter_config.json").is_file():
                async for _ in self.host.pull(hub_id, str(target), revision=revision,
                                              adapter=True):
                    pass
        return str(target)

    def _apply(self, record: ModelRecord, served: ServedModel) -> None:
        served.request_defaults = dict(record.parameters)
        served.chat_prompt = ChatPrompt.of(record.engine_parameters)

    # ---- pull --------------------------------------------------------------------------------

    def pull(self, body: dict) -> ModelRecord:
        source = body.get("model")
        if not isinstance(source, str) or not source.strip():
            raise ValidationError("`model` must name what to pull: a short name (gemma3-270m), a "
                                  "local model directory, a .gguf file or a Hugging Face Hub id")
        for key in body:
            if key not in ("model", "id", "name"):
                raise ValidationError(f"`{key}` is not supported by /v1/models/pull; it takes "
                                      "model, id and name")
        given = body.get("id")
        model_id = check_model_id(_id_of(source) if given is None else given)
        self._check_not_adapter(model_id)
        if len(source) > 4096 or not source.isprintable():
            raise ValidationError("`model` must be a path or a Hub id of at most 4096 printable "
                                  "characters")
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > 1000):
            raise ValidationError("`name` must be a string of at most 1000 characters")
        self._check_host()
        if len(self._pulls) >= MAX_PULLS:
            raise OverloadedError(f"{MAX_PULLS} pulls are under way; try again when one ends")
        existing = self.registry.records.get(model_id)
        if existing is not None and existing.state != NOT_DOWNLOADED:
            raise ModelStateError(f"model {model_id!r} already exists ({existing.state}); "
                                  "delete it first or pull under another id", existing.state)
        if model_id in self.served:
            raise ModelStateError(f"model {model_id!r} is running", RUNNING)
        target = directory_for(self.registry.models_dir, model_id)
        if target.exists():  # what an interrupted pull left
            shutil.rmtree(target, ignore_errors=True)
        record = ModelRecord(model_id, DOWNLOADING, model_dir=str(target), source=source,
                             owned=True, name=name or model_id.rsplit("/", 1)[-1])
        self.registry.add(record)
        task = asyncio.create_task(self._pull(record))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)
        return record

    async def _pull(self, record: ModelRecord) -> None:
        try:
            async for progress in self.host.pull(record.source, record.model_dir):
                record.bytes_done, record.bytes_total = progress.bytes_done, progress.bytes_total
                if progress.done:
                    record.format, record.quantization = progress.format, progress.quantization
                    record.size_bytes = progress.size_bytes
            record.parameter_count = await asyncio.to_thread(parameter_count, record.model_dir)
            record.state = DOWNLOADED
        except Exception as err:  # noqa: BLE001 (whatever went wrong is this pull's to report)
            record.state, record.error = NOT_DOWNLOADED, str(err) or type(err).__name__
            log.warning("pulling %s from %s failed: %s", record.id, record.source, err)
        except asyncio.CancelledError:
            record.state, record.error = NOT_DOWNLOADED, "the router stopped during the download"
            raise
        finally:
            if self.registry.records.get(record.id) is record:
                self.registry.save()

    # ---- start and stop ----------------------------------------------------------------------

    async def start(self, model_id: str) -> ModelRecord:
        record = self.registry.get(model_id)
        if record.state in (RUNNING, STARTING) and model_id not in self._moves:
            return record
        return await self._move(model_id, self._start)

    async def stop(self, model_id: str) -> ModelRecord:
        record = self.registry.get(model_id)
        if record.state in (STOPPED, DOWNLOADED) and model_id not in self._moves:
            return record
        return await self._move(model_id, self._stop)

    async def _move(self, model_id: str, work) -> ModelRecord:
        """One start or stop at a time per model, in a task of its own: a second call waits for
        the one under way (start and stop are idempotent), then does its own on the record as
        that one left it; a caller that goes away leaves its task running to its end."""
        while (task := self._moves.get(model_id)) is not None:
            try:
                await asyncio.shield(task)
            except Exception:  # noqa: BLE001 (that call's failure was its caller's to hear)
                pass
        if self._closing:
            raise ModelHostMissingError("the server is stopping")
        task = asyncio.create_task(work(self.registry.get(model_id)))
        self._moves[model_id] = task
        task.add_done_callback(
            lambda done: self._moves.pop(model_id) if self._moves.get(model_id) is done else None)
        return await asyncio.shield(task)

    async def _start(self, record: ModelRecord) -> ModelRecord:
        if record.state in (RUNNING, STARTING):
            return record
        self._check_host()
        self._check_not_adapter(record.id)
        before = record.state
        self._check_context(record)
        self.registry.move(record, STARTING, allowed_from=SERVABLE, action="start")
        record.error = None
        settings = record.settings
        try:
            socket = await self.host.start_group(
                record.id, record.model_dir, num_shard=settings.get("num_shard", 1),
                dtype=settings.get("dtype", self.default_dtype),
                device="cpu" if settings.get("ngl") == 0 else self.default_device)
            try:
                served = await build_served(model_config(
                    self.config, model_id=record.id, model_dir=record.model_dir,
                    master_socket=socket, settings=settings))
            except BaseException:
                await self.host.stop_group(record.id)
                raise
        except Exception as err:  # noqa: BLE001 (a tokenizer that fails to load, ...)
            record.state, record.error = before, str(err) or type(err).__name__
            self.registry.save()
            error = ValidationError if isinstance(err, ValueError) else ModelStartError
            raise error(f"model {record.id!r} did not start: {record.error}") from None
        except BaseException:
            record.state = before
            self.registry.save()
            raise
        self._apply(record, served)
        served.start(self.supervise)
        self._serve(record.id, served)
        self.registry.move(record, RUNNING, allowed_from=(STARTING,), action="run")
        log.info("model %s is running", record.id)
        return record

    def _check_context(self, record: ModelRecord) -> None:
        ctx_len = record.settings.get("ctx_len")
        if ctx_len is None or record.model_dir is None:
            return
        try:
            config = json.loads((Path(record.model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            return  # the start reports what is wrong with the directory
        context = config.get("max_position_embeddings")
        if isinstance(context, int) and ctx_len > context:
            raise ValidationError(f"settings.ctx_len {ctx_len} exceeds the context of model "
                                  f"{record.id!r} ({context} tokens)")

    async def _stop(self, record: ModelRecord, *, drain: bool = True) -> ModelRecord:
        if record.state in (STOPPED, DOWNLOADED):
            return record
        self.registry.move(record, STOPPING, allowed_from=(RUNNING,), action="stop")
        served = self.served.pop(record.id, None)  # new requests for it get a 409 from now on
        try:
            if served is not None:
                if drain:
                    await _drain(served, DRAIN_TIMEOUT_S)
                await served.close()
            if self.host is not None:
                await self.host.stop_group(record.id)
        except ModelHostError as err:
            log.warning("stopping the shards of %s: %s", record.id, err)
        finally:
            record.state = STOPPED
            self.registry.save()
        log.info("model %s is stopped", record.id)
        return record

    async def settle_lost_groups(self, interval: float = LOST_GROUP_CHECK_S) -> None:
        """A model whose shards stay lost is asked about: when the launcher gave its group up
        (its ranks died more often than --max-shard-restarts allows), the model stops here too,
        with the reason in its record, instead of waiting for shards that will never return.
        The default model is not asked: the launcher stops everything when its group goes."""
        while True:
            await asyncio.sleep(interval)
            lost = [name for name, served in self.served.items()
                    if name != self.default_id and served.batcher.recovery is not None
                    and served.batcher.recovery.lost_since is not None]
            if not lost:
                continue
            try:
                alive = await self.host.groups()
            except ModelHostError as err:
                log.debug("asking the model host for its groups: %s", err)
                continue
            for name in lost:
                record = self.registry.records.get(name)
                if name in alive or record is None or name in self._moves:
                    continue
                log.error("the shards of %s died more often than --max-shard-restarts allows "
                          "and the launcher gave them up; stopping the model", name)
                record.error = ("its shards died more often than --max-shard-restarts allows; "
                                "start it again to retry")
                try:  # its queued requests would only wait for their 503
                    await self._move(name, lambda record: self._stop(record, drain=False))
                except Exception as err:  # an OSError saving the registry too: keep watching
                    log.warning("stopping %s: %s", name, err)

    async def autostart(self) -> None:
        """--autostart: models that were running when the registry was last saved start again."""
        for record in list(self.registry.records.values()):
            if record.was_running and record.state == STOPPED and record.id not in self.served:
                try:
                    await self.start(record.id)
                except RouterError as err:
                    log.error("--autostart: %s", err)

    # ---- delete and patch --------------------------------------------------------------------

    async def delete(self, model_id: str) -> None:
        record = self.registry.get(model_id)
        if record.state in BUSY or model_id in self._moves:
            raise ModelStateError(f"model {model_id!r} cannot be deleted: it is {record.state}"
                                  + (" (stop it first)" if record.state == RUNNING else ""),
                                  record.state)
        self.registry.remove(model_id)
        if record.owned and record.model_dir and self.registry.models_dir is not None:
            path = Path(record.model_dir)
            if path.resolve().parent == self.registry.models_dir.resolve():
                await asyncio.to_thread(shutil.rmtree, path, True)

    def patch(self, model_id: str, body: dict) -> ModelRecord:
        record = self.registry.get(model_id)
        tables = {"settings": SETTINGS, "parameters": PARAMETERS,
                  "engine_parameters": ENGINE_PARAMETERS}
        for key in body:
            if key not in (*tables, "name", "description"):
                raise ValidationError(f"`{key}` cannot be changed; PATCH takes "
                                      f"{', '.join(tables)}, name and description")
        changes = {}
        for group, table in tables.items():
            if group in body:
                given = body[group]
                if isinstance(given, dict):  # a key set to null is removed: it must exist too
                    check_keys(group, given, table)
                removed = [k for k, v in (given or {}).items() if v is None] \
                    if isinstance(given, dict) else []
                kept = {k: v for k, v in given.items() if v is not None} \
                    if isinstance(given, dict) else given
                merged = {**getattr(record, group), **checked(group, kept, table)}
                changes[group] = {k: v for k, v in merged.items() if k not in removed}
        for key in ("name", "description"):
            if key in body:
                if not isinstance(body[key], str) or len(body[key]) > 1000:
                    raise ValidationError(f"`{key}` must be a string of at most 1000 characters")
                changes[key] = body[key]
        for key, value in changes.items():
            setattr(record, key, value)
        if record.id in self.served:
            self._apply(record, self.served[record.id])  # settings wait for the next start
        self.registry.save()
        return record

    async def close(self) -> None:
        self._closing = True
        tasks = [*self._pulls, *self._moves.values()]
        for task in tasks:  # a start cancelled mid-way stops the shard group it began
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for served in list(self.served.values()):
            await served.close()
        if self.host is not None:
            await self.host.close()
        self.registry.close()


async def _drain(served: ServedModel, timeout: float) -> None:
    """Waits until the model's requests in flight are done; past `timeout`, fails the rest."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while served.infer.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if served.infer.in_flight:
        log.warning("%s: %d requests still in flight after %.0f s; they fail",
                    served.model_name, served.infer.in_flight, timeout)


def _id_of(source: str) -> str:
    """The id a pull gets when it names none: a directory's or a file's name, or the Hub id."""
    path = Path(source.rstrip("/"))
    if source.startswith(("/", "./", "../", "~")) or path.suffix == ".gguf":
        return path.stem if path.suffix == ".gguf" else path.name
    return source


def _size(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0
