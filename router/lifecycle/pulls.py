"""Pulls: a model's files into the registry's directory, a Hub LoRA adapter's into its cache.

Both go through the launcher's model host, which fetches and converts; a model's pull runs as a
task of its own, its progress in the model's record (router/lifecycle/registry.py).
"""
from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable, Container
from pathlib import Path

from router.errors import (LocalPathRefusedError, ModelHostMissingError, ModelStateError,
                           OverloadedError, ValidationError)
from router.lifecycle.hub_names import hub_name
from router.lifecycle.local_paths import REFUSAL, LocalRoots, is_path_like
from router.lifecycle.model_host import ModelHostClient
from router.lifecycle.registry import (DOWNLOADED, DOWNLOADING, NOT_DOWNLOADED, RUNNING,
                                       ModelRecord, ModelRegistry, check_model_id, directory_for,
                                       parameter_count)

log = logging.getLogger("tgi.router")

MAX_PULLS = 4  # pulls at once: each holds one of the model host's workers (launcher/model_host.py)


def check_host(registry: ModelRegistry, host: ModelHostClient | None) -> None:
    """ModelHostMissingError unless models can be pulled, started and stopped here."""
    if registry.unavailable is not None:
        raise ModelHostMissingError(registry.unavailable)
    if host is None or registry.models_dir is None:
        raise ModelHostMissingError()


class ModelPulls:
    """The pulls under way, and the Hub adapters fetched into the registry's cache."""

    def __init__(self, registry: ModelRegistry, host: ModelHostClient | None, *,
                 local_roots: LocalRoots = LocalRoots()):
        self.registry = registry
        self.host = host
        self.local_roots = local_roots  # where a pull may read local files (local_paths.py)
        self.tasks: set[asyncio.Task] = set()
        self._adapter_fetches: dict[str, asyncio.Lock] = {}  # by cache directory name

    def pull(self, body: dict, *, refuse_id: Callable[[str], None],
             running: Container[str]) -> ModelRecord:
        """Starts pulling what `body` names (POST /v1/models/pull); its record says how it goes.

        `refuse_id` raises for an id taken otherwise (a LoRA adapter's); `running`: the ids of
        the models running.
        """
        source = body.get("model")
        if not isinstance(source, str) or not source.strip():
            raise ValidationError("`model` must name what to pull: a short name (gemma3-270m), a "
                                  "local model directory, a .gguf file, a Hugging Face Hub id or "
                                  "URL, or Cortex's owner/repo:quant")
        for key in body:
            if key not in ("model", "id", "name"):
                raise ValidationError(f"`{key}` is not supported by /v1/models/pull; it takes "
                                      "model, id and name")
        hub = hub_name(source)  # Jan's and Cortex's names of Hub files; a 422 if unreadable
        given = body.get("id")
        model_id = check_model_id((hub.model_id if hub else _id_of(source)) if given is None
                                  else given)
        refuse_id(model_id)
        if len(source) > 4096 or not source.isprintable():
            raise ValidationError("`model` must be a path or a Hub id of at most 4096 printable "
                                  "characters")
        name = body.get("name")
        if name is not None and (not isinstance(name, str) or len(name) > 1000):
            raise ValidationError("`name` must be a string of at most 1000 characters")
        check_host(self.registry, self.host)
        if is_path_like(source) and not self.local_roots.allows(source):
            raise LocalPathRefusedError(REFUSAL)
        if len(self.tasks) >= MAX_PULLS:
            raise OverloadedError(f"{MAX_PULLS} pulls are under way; try again when one ends")
        existing = self.registry.records.get(model_id)
        if existing is not None and existing.state != NOT_DOWNLOADED:
            raise ModelStateError(f"model {model_id!r} already exists ({existing.state}); "
                                  "delete it first or pull under another id", existing.state)
        if model_id in running:
            raise ModelStateError(f"model {model_id!r} is running", RUNNING)
        target = directory_for(self.registry.models_dir, model_id)
        if target.exists():  # what an interrupted pull left
            shutil.rmtree(target, ignore_errors=True)
        record = ModelRecord(model_id, DOWNLOADING, model_dir=str(target), source=source,
                             owned=True, name=name or model_id.rsplit("/", 1)[-1])
        self.registry.add(record)
        task = asyncio.create_task(self._pull(record))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return record

    async def _pull(self, record: ModelRecord) -> None:
        forgotten: list[str] = []
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
            forgotten = self.registry.forget_failed_pulls()
            if forgotten:
                log.info("forgot the oldest failed pulls: %s", ", ".join(forgotten))
        except asyncio.CancelledError:
            record.state, record.error = NOT_DOWNLOADED, "the router stopped during the download"
            raise
        finally:
            if forgotten or self.registry.records.get(record.id) is record:
                self.registry.save()

    async def fetch_adapter(self, hub_id: str, revision: str | None, max_bytes: int) -> str:
        """A Hub adapter's directory in the cache, fetched by the launcher the first time.

        The cache is <registry>/adapters/<org%2Fname[@rev]>. A source whose files hold more than
        `max_bytes` (0: no bound) is refused before anything is downloaded.
        """
        name = hub_id.replace("/", "%2F") + (f"@{revision.replace('/', '%2F')}" if revision
                                             else "")
        target = self.registry.directory / "adapters" / name
        # two loads of one Hub id under two names: the second waits for the first's pull
        async with self._adapter_fetches.setdefault(name, asyncio.Lock()):
            if not (target / "adapter_config.json").is_file():
                async for _ in self.host.pull(hub_id, str(target), revision=revision,
                                              adapter=True, max_bytes=max_bytes):
                    pass
        return str(target)


def _id_of(source: str) -> str:
    """The id a pull gets when it names none: a directory's or a file's name, or the Hub id."""
    path = Path(source.rstrip("/"))
    if source.startswith(("/", "./", "../", "~")) or path.suffix == ".gguf":
        return path.stem if path.suffix == ".gguf" else path.name
    return source
