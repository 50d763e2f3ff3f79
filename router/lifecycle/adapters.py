"""The LoRA adapters one running model has loaded: names, files, and what the shards read of them.

`served.adapters` of each ServedModel, an AdapterStore. A load finds the adapter's directory (a
local one, or a Hub id the launcher's model host fetches into the models cache: `links.fetch`),
checks its files, and asks
every shard rank to load it; the name then opens in the generation core's gate
(router/core/adapter_use.py). An unload closes the name at once, waits until no queued or running
request uses it, and frees it on every rank. A restarted shard group has none: `reload_all` loads
every adapter again before requests run on it (router/lifecycle/served_model.py's recovery).
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from router.config.model import MAX_LORAS
from router.config.server import adapter_name_problem
from router.core.adapter_use import AdapterUse
from router.errors import AdapterError, UnhealthyError, UnknownAdapterError
from router.lifecycle.local_paths import LocalRoots, is_path_like
from router.scheduler.batcher import Batcher
from router.shards.client import ShardedClient, ShardError
from router.telemetry.metrics import Metrics

log = logging.getLogger("tgi.router.adapters")

# a Hub id, optionally @revision (a branch, tag or commit)
HUB_ID = re.compile(r"([A-Za-z0-9_][A-Za-z0-9._-]*/[A-Za-z0-9_][A-Za-z0-9._-]*)"
                    r"(?:@([A-Za-z0-9._/-]{1,128}))?")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
POLL_S = 0.02  # how often an unload looks whether the adapter's requests are done
BUSY_RETRY_S = 10.0  # how long an unload retries while a shard batch still holds a request on it

# the one answer to a local path outside the allowed directories, whether or not it exists
LOCAL_REFUSAL = ("`lora_path` names a local path this server may not load adapters from: a local "
                 "adapter is loaded only from under the directories its operator allows "
                 "(--allowed-local-model-path)")

# (Hub id, revision or None, the most bytes its files may hold) -> the local directory the
# launcher fetched it into
Fetch = Callable[[str, str | None, int], Awaitable[str]]


def _no_other_use(name: str) -> str | None:
    return None


@dataclass(frozen=True, slots=True)
class AdapterLinks:
    """What an adapter store asks of the server beyond its own model (the model manager's)."""

    fetch: Fetch | None = None  # Hub ids through the launcher (None: local directories only)
    # what else a name names, if anything: a model, or another model's adapter
    name_taken: Callable[[str], str | None] = _no_other_use
    # where a load asked for by a client may read a local directory (None: anywhere); the
    # operator's --lora-adapters are read wherever they are
    local_roots: LocalRoots | None = None


@dataclass(slots=True)
class AdapterEntry:
    name: str
    source: str  # as it was given: a directory, or a Hub id with its @revision
    path: str  # the local directory the shards read
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    base_model: str  # its config's base_model_name_or_path ("": not said)
    created: int = field(default_factory=lambda: int(time.time()))

    def info_json(self, parent: str) -> dict:
        """/info's item."""
        return {"name": self.name, "parent": parent, "source": self.source, "path": self.path,
                "rank": self.rank, "alpha": self.alpha, "scaling": self.scaling,
                "target_modules": list(self.target_modules), "base_model": self.base_model,
                "created": self.created}


def check_name(name: object) -> str:
    problem = adapter_name_problem(name)
    if problem is not None:
        raise AdapterError(problem)
    return name


def local_directory(source: str) -> Path | None:
    """The directory `source` names, or None when it reads as a Hub id.

    AdapterError when it is a path with no adapter there (checked before any shard is asked).
    """
    looks_local = source.startswith(("/", "./", "../", "~")) or not HUB_ID.fullmatch(source)
    try:
        path = Path(source).expanduser()
        is_dir = path.is_dir()
        if is_dir:
            has_config = (path / "adapter_config.json").is_file()
            has_weights = any((path / f).is_file() for f in WEIGHT_FILES)
    except (OSError, RuntimeError, ValueError):  # "~nobody/x", a NUL byte: no directory
        is_dir = False
    if not is_dir:
        if looks_local:
            raise AdapterError(f"no adapter directory at {source[:500]!r}: give a directory "
                               "holding adapter_config.json and adapter_model.safetensors, or a "
                               "Hugging Face Hub id (org/name or org/name@revision)")
        return None
    if not has_config:
        raise AdapterError(f"{source!r} holds no adapter_config.json: not a PEFT LoRA adapter")
    if not has_weights:
        raise AdapterError(f"{source!r} holds no adapter weights ({' or '.join(WEIGHT_FILES)})")
    return path.resolve()


def _files_allowed(path: Path, roots: LocalRoots) -> bool:
    """Whether the files the shards will read in `path` are under `roots` (not links out)."""
    try:
        return all(roots.allows(path / name) for name in ("adapter_config.json", *WEIGHT_FILES)
                   if (path / name).exists())
    except OSError:  # unreadable: refused with the one message, as any path outside
        return False


class AdapterStore:
    """One model's LoRA adapters: load, unload, reload after a restart, and what requests see."""

    def __init__(self, client: ShardedClient, use: AdapterUse, batcher: Batcher,
                 metrics: Metrics, *, parent: str, links: AdapterLinks = AdapterLinks(),
                 max_loras: int = MAX_LORAS, max_files_bytes: int | None = None):
        self.client = client
        self.use = use
        self.batcher = batcher
        self.metrics = metrics
        self.parent = parent  # the base model's id, as /v1/models lists it
        self.links = links
        self.max_loras = max_loras  # adapters held at once, those loading or unloading included
        # the most a Hub adapter's files may hold, checked before they are downloaded (the
        # shards' largest adapter; None: no bound)
        self.max_files_bytes = max_files_bytes
        self._entries: dict[str, AdapterEntry] = {}
        self._loading: set[str] = set()
        self._unloads: dict[str, asyncio.Task] = {}
        # unloaded here, but the shards' unload call failed: their tensors may still be held,
        # so they count against max_loras until freed (a later load frees them first)
        self._stale: set[str] = set()
        # shard adapter calls one at a time, so that a reload after a restart and a load or
        # unload never interleave on the ranks
        self._shard_calls = asyncio.Lock()
        metrics.adapters_loaded.set(0)

    # ---- what requests see ------------------------------------------------------------------

    def check(self, name: str) -> None:
        """UnknownAdapterError unless `name` is loaded and open to new requests."""
        self.use.check(name)

    def names(self) -> list[str]:
        """Loaded adapters, those being unloaded included."""
        return sorted(self._entries)

    def get(self, name: str) -> AdapterEntry | None:
        return self._entries.get(name)

    def entries(self) -> list[AdapterEntry]:
        return [self._entries[n] for n in self.names()]

    def has(self, name: str) -> bool:
        """Whether `name` is loaded, being loaded or being unloaded here."""
        return name in self._entries or name in self._loading

    def resolve_path(self, path: str) -> str | None:
        """The open adapter whose directory or source is `path` (SGLang's lora_path)."""
        try:
            resolved = str(Path(path).expanduser().resolve())
        except (OSError, RuntimeError, ValueError):  # "~nobody/x", a NUL: no directory of ours
            resolved = path
        for name in self.use.names():
            entry = self._entries.get(name)
            if entry is not None and (path == entry.source or resolved == entry.path):
                return name
        return None

    def info_json(self) -> list[dict]:
        return [e.info_json(self.parent) for e in self.entries()]

    # ---- load and unload --------------------------------------------------------------------

    async def load(self, name: str, source: str, *, operator: bool = False) -> AdapterEntry:
        """Loads `source` under `name` on every rank.

        `source`: a local adapter directory, or a Hub id fetched by the launcher. AdapterError
        (400) for a bad name, source or adapter, and for a name in use; nothing changes then.
        operator: named by --lora-adapters, so read wherever it is (`links.local_roots` bounds
        the others).
        """
        check_name(name)
        if not isinstance(source, str) or not source.strip() or len(source) > 4096:
            raise AdapterError("the adapter's path must be a directory or a Hub id of at most "
                               "4096 characters")
        if self.has(name):
            raise AdapterError(f"The lora adapter {name!r} has already been loaded.")
        taken = self.links.name_taken(name)
        if taken is not None:
            raise AdapterError(f"{name!r} is {taken}: adapters and models share the names a "
                               "request's `model` gives; pick another name")
        held = len(self._entries) + len(self._loading) + len(self._stale)
        if held >= self.max_loras and self._stale:
            await self._free_stale()
            held = len(self._entries) + len(self._loading) + len(self._stale)
        if held >= self.max_loras:
            raise AdapterError(f"adapter {name!r} cannot be loaded: {self.parent} holds {held} "
                               f"LoRA adapters, the most --max-loras ({self.max_loras}) allows; "
                               "unload one first (POST /v1/unload_lora_adapter)")
        if not self.batcher.healthy:
            raise UnhealthyError("the model shards are restarting; load the adapter once they "
                                 "are back")
        self._loading.add(name)
        # in a task of its own: a caller that goes away never leaves the ranks half loaded
        task = asyncio.create_task(self._load(name, source, operator))
        task.add_done_callback(lambda _: self._loading.discard(name))
        return await asyncio.shield(task)

    async def _load(self, name: str, source: str, operator: bool) -> AdapterEntry:
        path = await self._directory(source, None if operator else self.links.local_roots)
        async with self._shard_calls:
            info = await self._load_on_shards(name, str(path))
        entry = AdapterEntry(name, source, str(path), info.rank, info.alpha, info.scaling,
                             info.target_modules, info.base_model)
        self._entries[name] = entry
        self.use.open(name)
        self.metrics.adapters_loaded.set(len(self._entries))
        log.info("%s: loaded LoRA adapter %s from %s (rank %d, %s)", self.parent, name, source,
                 info.rank, ", ".join(info.target_modules))
        return entry

    async def _directory(self, source: str, roots: LocalRoots | None) -> Path:
        """The local directory of `source`: itself, or a Hub id's files fetched.

        With `roots`, nothing outside them is looked at: a path there is refused with one
        message, and an `org/name` there is a Hub id.
        """
        if roots is None or await asyncio.to_thread(roots.allows, source):
            path = await asyncio.to_thread(local_directory, source)
            if path is not None and roots is not None and not await asyncio.to_thread(
                    _files_allowed, path, roots):
                raise AdapterError(LOCAL_REFUSAL)
            if path is not None:
                return path
        elif is_path_like(source) or not HUB_ID.fullmatch(source):
            raise AdapterError(LOCAL_REFUSAL)
        match = HUB_ID.fullmatch(source)
        if self.links.fetch is None:
            raise AdapterError(f"{source!r} is no local directory, and Hub ids need tgi-launcher's "
                               "model host (this router runs without it): give a directory")
        if self.max_files_bytes == 0:
            raise AdapterError(f"{self.parent}'s layers take no LoRA adapters")
        try:
            fetched = await self.links.fetch(match.group(1), match.group(2),
                                             self.max_files_bytes or 0)
        except AdapterError:
            raise
        except Exception as err:  # noqa: BLE001 (the launcher's reason is the answer)
            raise AdapterError(f"fetching adapter {source!r} failed: {err}") from None
        return await asyncio.to_thread(local_directory, fetched)

    async def _load_on_shards(self, name: str, path: str):
        try:
            return await self.client.load_adapter(name, path)
        except ShardError as err:
            if err.code != "ALREADY_EXISTS":
                raise _load_error(name, err) from None
        # left on the shards by an unload whose shard call failed: free it, try again
        try:
            await self.client.unload_adapter(name)
        except ShardError as err:
            raise _load_error(name, err) from None
        self._stale.discard(name)
        return await self._load_on_shards_once(name, path)

    async def _free_stale(self) -> None:
        async with self._shard_calls:
            await self._free_stale_held()

    async def _free_stale_held(self) -> None:
        """Tries again to free the adapters whose unload failed on the shards (lock held)."""
        for name in sorted(self._stale):
            try:
                await self._unload_on_shards(name)
            except ShardError as err:
                log.warning("%s: adapter %s is still held by the shards (%s)", self.parent,
                            name, err)
                continue
            self._stale.discard(name)

    async def _load_on_shards_once(self, name: str, path: str, *, raw: bool = False):
        """raw: the shards' ShardError as it is, not the API's AdapterError."""
        try:
            return await self.client.load_adapter(name, path)
        except ShardError as err:
            if raw:
                raise
            raise _load_error(name, err) from None

    async def unload(self, name: str) -> None:
        """Unloads `name` once no queued or running request uses it.

        It is refused to new requests at once, then freed on every rank once no request uses
        it. UnknownAdapterError when it is not loaded. An unload under way is joined; a caller
        that goes away leaves it running to its end.
        """
        task = self._unloads.get(name)
        if task is None:
            if name not in self._entries:
                raise UnknownAdapterError(name, self.names())
            task = asyncio.create_task(self._unload(name))
            self._unloads[name] = task
            task.add_done_callback(lambda _: self._unloads.pop(name, None))
        await asyncio.shield(task)

    async def _unload(self, name: str) -> None:
        self.use.close(name)
        while self.use.in_flight[name] or self._queued_or_running(name):
            await asyncio.sleep(POLL_S)
        # a restarted group is not given it back; one that refused it meanwhile dropped it
        entry = self._entries.pop(name, None)
        self.metrics.adapters_loaded.set(len(self._entries))
        if entry is None:
            self.batcher.forget_adapter(name)
            return
        try:
            async with self._shard_calls:
                await self._unload_on_shards(name)
        except ShardError as err:
            self._stale.add(name)
            log.warning("%s: unloading adapter %s from the shards failed (%s); it counts "
                        "against --max-loras until a next load frees it", self.parent, name, err)
            raise AdapterError(f"the shards could not unload adapter {name!r}: {err}",
                               status=424) from None
        finally:
            self.batcher.forget_adapter(name)
            self.metrics.counters.forget("tgi_request_adapter_count", adapter=name)
        log.info("%s: unloaded LoRA adapter %s (%s)", self.parent, name, entry.source)

    def _queued_or_running(self, name: str) -> bool:
        waiting, running = self.batcher.requests_by_adapter()
        return bool(waiting[name] or running[name])

    async def _unload_on_shards(self, name: str) -> None:
        deadline = time.monotonic() + BUSY_RETRY_S
        while True:
            try:
                return await self.client.unload_adapter(name)
            except ShardError as err:
                # a shard batch may hold a finished request until its next step filters it
                if err.code != "FAILED_PRECONDITION" or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(POLL_S)

    async def reload_all(self) -> None:
        """Loads every adapter into a restarted shard group (which has none).

        Done before requests run on it. An adapter the new group refuses (its files gone
        meanwhile) is dropped, with the reason logged; a group that fails the call (gone again)
        raises, to be retried.
        """
        async with self._shard_calls:
            await self._free_stale_held()  # a restarted group holds none: they go at once
            for entry in self.entries():
                try:
                    await self._load_on_shards_once(entry.name, entry.path, raw=True)
                except ShardError as err:
                    if err.code == "ALREADY_EXISTS":  # some rank kept it: all start over
                        await self.client.unload_adapter(entry.name)
                        await self.client.load_adapter(entry.name, entry.path)
                        continue
                    if err.code not in ("INVALID_ARGUMENT", "NOT_FOUND"):
                        raise
                    log.error("%s: the restarted shards refused adapter %s (%s); it is no "
                              "longer served", self.parent, entry.name, err)
                    self.use.close(entry.name)
                    del self._entries[entry.name]
        self.metrics.adapters_loaded.set(len(self._entries))


def _load_error(name: str, err: ShardError) -> AdapterError:
    if err.code in ("INVALID_ARGUMENT", "ALREADY_EXISTS", "NOT_FOUND"):
        return AdapterError(f"adapter {name!r} cannot be loaded: {err}")
    return AdapterError(f"the shards failed loading adapter {name!r}: {err}", status=424)
