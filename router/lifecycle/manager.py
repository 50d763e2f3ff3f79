"""The model lifecycle: start, stop, delete and patch the registry's models, and find them by name.

The registry (router/lifecycle/registry.py) holds the states; the launcher's model host fetches files
(router/lifecycle/pulls.py) and runs shard groups; each running model is a ServedModel with its own
scheduler. Start and stop run as tasks of their own, so a client that hangs up mid-way never leaves
a model half started.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from router.config.model import ModelSettings
from router.errors import (InvalidModelIdError, ModelHostMissingError, ModelNotFoundError,
                           ModelStartError, ModelStateError, RouterError, UnknownAdapterError,
                           ValidationError)
from router.lifecycle.adapters import AdapterEntry, AdapterLinks
from router.lifecycle.copies import copy_model
from router.lifecycle.limits import check_context
from router.lifecycle.local_paths import LocalRoots
from router.lifecycle.model_host import ModelHostClient, ModelHostError
from router.lifecycle.pulls import ModelPulls, check_host
from router.lifecycle.registry import (BUSY, DOWNLOADED, NOT_DOWNLOADED, RUNNING, SERVABLE,
                                       STARTING, STOPPED, STOPPING, ModelRecord, ModelRegistry,
                                       check_model_id, parameter_count)
from router.lifecycle.served_model import ServedModel, build_served
from router.lifecycle.settings import ChatPrompt, model_settings, patched

log = logging.getLogger("tgi.router")

# the TGI routes name no model; OpenAI clients of TGI send any name, often "tgi"
UNNAMED_MODELS = (None, "", "tgi")  # names that mean "the model", whatever its id
DRAIN_TIMEOUT_S = 60.0  # how long a stop waits for the model's requests in flight
LOST_GROUP_CHECK_S = 2.0  # how often models whose shards are lost are asked about


class ModelManager:
    """The models this server serves or knows: the running ones by name, and their lifecycle."""

    def __init__(self, model_defaults: ModelSettings, registry: ModelRegistry,
                 host: ModelHostClient | None, *, supervise: Callable, default_dtype: str = "",
                 default_device: str = "auto", local_roots: LocalRoots = LocalRoots()):
        self.model_defaults = model_defaults  # what a model started later begins from
        self.registry = registry
        self.host = host
        self.supervise = supervise  # wraps each model's batching loop
        self.default_dtype = default_dtype
        self.default_device = default_device
        self.served: dict[str, ServedModel] = {}
        self.default_id: str | None = None
        self.pulls = ModelPulls(registry, host, local_roots=local_roots)
        # what every model's adapter store asks of the server: Hub adapters come through the
        # model host, and a name may not be a model's or another model's adapter's
        self.adapter_links = AdapterLinks(
            fetch=self.pulls.fetch_adapter if host is not None and registry.directory is not None
            else None, name_taken=self._name_use, local_roots=local_roots)
        self._moves: dict[str, asyncio.Task] = {}  # a start or stop under way, by model id
        self._closing = False

    # ---- serving ---------------------------------------------------------------------------

    def add_default(self, served: ServedModel) -> None:
        """The launcher's --model-id: the default, running from the start.

        Recorded in the registry when its name is a valid id (a path given as --model-id is
        served unrecorded).
        """
        model_id = served.model_name
        self.default_id = model_id
        self.served[model_id] = served
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

    def served_model(self, name: str | None) -> ServedModel:
        """The running model a request names: 404 when no model has that name, 409 when not running.

        While one model runs, a name nobody knows is that model, as TGI ignores the name (models
        merely on disk do not change how a one-model server answers).
        """
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
        """The running model that has a LoRA adapter named `name`, and the name; None if none has.

        An adapter being unloaded counts: its requests then hear that it is not loaded.
        """
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
        """Loads an adapter into `model`; 404/409 as served_model answers.

        None names the default model, or the one running model.
        """
        served = self.served_model(model)
        return served, await served.adapters.load(name, source)

    async def unload_adapter(self, name: str) -> ServedModel:
        """Unloads adapter `name` from the model that has it; UnknownAdapterError if none."""
        found = self.adapter_model(name)
        if found is None:
            raise UnknownAdapterError(name, self.adapter_names())
        await found[0].adapters.unload(name)
        return found[0]

    def _name_use(self, name: str) -> str | None:
        """What else a new adapter's `name` names, if anything: a model, or a model's adapter.

        The store loading it has already refused a name of its own adapters.
        """
        if name in self.served or name in self.registry.records:
            return "the id of a model"
        for model_id, served in self.served.items():
            if served.adapters.has(name):
                return f"an adapter of model {model_id!r}"
        return None

    def _check_not_adapter(self, model_id: str) -> None:
        found = self.adapter_model(model_id)
        if found is not None:
            raise InvalidModelIdError(f"{model_id!r} is the name of a LoRA adapter of model "
                                      f"{found[0].model_name!r}: models and adapters share the "
                                      "names a request's `model` gives; pick another id")

    def _apply(self, record: ModelRecord, served: ServedModel) -> None:
        served.request_defaults = dict(record.parameters)
        served.embedding_asked = bool(record.settings.get("embedding"))
        served.chat_prompt = ChatPrompt.of(record.engine_parameters)

    # ---- pull --------------------------------------------------------------------------------

    def pull(self, body: dict) -> ModelRecord:
        """Starts pulling what `body` names (POST /v1/models/pull); its record says how it goes."""
        return self.pulls.pull(body, refuse_id=self._check_not_adapter, running=self.served)

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
        """One start or stop at a time per model, in a task of its own.

        A second call waits for the one under way (start and stop are idempotent), then does its
        own on the record as that one left it; a caller that goes away leaves its task running to
        its end.
        """
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
        check_host(self.registry, self.host)
        self._check_not_adapter(record.id)
        before = record.state
        check_context(record.id, record.model_dir, record.settings.get("ctx_len"))
        self.registry.move(record, STARTING, allowed_from=SERVABLE, action="start")
        record.error = None
        settings = record.settings
        try:
            socket = await self.host.start_group(
                record.id, record.model_dir, num_shard=settings.get("num_shard", 1),
                dtype=settings.get("dtype", self.default_dtype),
                device="cpu" if settings.get("ngl") == 0 else self.default_device,
                cpu_threads=settings.get("cpu_threads", 0))
            try:
                served = await build_served(model_settings(
                    self.model_defaults, model_id=record.id, model_dir=record.model_dir,
                    master_socket=socket, settings=settings), adapter_links=self.adapter_links)
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
        self.served[record.id] = served
        self.registry.move(record, RUNNING, allowed_from=(STARTING,), action="run")
        log.info("model %s is running", record.id)
        return record

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
        """Stops the models whose shard groups the launcher gave up, with the reason in the record.

        A model whose shards stay lost is asked about: when the launcher gave its group up (its
        ranks died more often than --max-shard-restarts allows), the model stops here too,
        instead of waiting for shards that will never return. The default model is not asked: the
        launcher stops everything when its group goes.
        """
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

    async def copy(self, source_id: str, destination_id: str) -> ModelRecord:
        """A stopped copy of a downloaded model under another id (router/lifecycle/copies.py)."""
        check_model_id(destination_id)
        self._check_not_adapter(destination_id)
        return await copy_model(self.registry, source_id, destination_id,
                                running=destination_id in self.served)

    def patch(self, model_id: str, body: dict) -> ModelRecord:
        """Changes a model's settings, request defaults, name or description (PATCH)."""
        record = self.registry.get(model_id)
        for key, value in patched(record, body).items():
            setattr(record, key, value)
        if record.id in self.served:
            self._apply(record, self.served[record.id])  # settings wait for the next start
        self.registry.save()
        return record

    async def close(self) -> None:
        self._closing = True
        tasks = [*self.pulls.tasks, *self._moves.values()]
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


def _size(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0

