"""The models this server knows, kept in a JSON file under the cache directory.

Where each one's files are, its state, its settings and request defaults, kept so that they
survive a restart.

States follow Jan/Cortex: not_downloaded -> downloading -> downloaded -> starting -> running ->
stopping -> stopped (and stopped -> starting again). A move the table does not allow is a 409 that
names the current state.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from router.errors import InvalidModelIdError, ModelNotFoundError, ModelStateError, RouterError
from router.lifecycle.settings import ENGINE_PARAMETERS, PARAMETERS, SETTINGS, checked

log = logging.getLogger("tgi.router")

NOT_DOWNLOADED, DOWNLOADING, DOWNLOADED = "not_downloaded", "downloading", "downloaded"
STARTING, RUNNING, STOPPING, STOPPED = "starting", "running", "stopping", "stopped"
STATES = (NOT_DOWNLOADED, DOWNLOADING, DOWNLOADED, STARTING, RUNNING, STOPPING, STOPPED)
SERVABLE = (DOWNLOADED, STOPPED)  # a model in these states may start
BUSY = (DOWNLOADING, STARTING, RUNNING, STOPPING)  # a model in these states may not be deleted

# failed pulls kept, the newest: each keeps its reason for the client that pulled, and without a
# bound every pull of a bad source would grow the file rewritten on each change (400 failures made
# it 226 KB). A count, not an age: it bounds the file however fast pulls fail, and a failure stays
# readable until newer ones push it out, however slowly its client comes back to read it
MAX_FAILED_PULLS = 16

# an id is a name or an owner/name pair, as on the Hub; no segment may be "." or "..", which the
# first character's class already rules out
_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?")


def check_model_id(model_id: object) -> str:
    if not isinstance(model_id, str) or not _ID.fullmatch(model_id):
        raise InvalidModelIdError(
            f"invalid model id {str(model_id)[:200]!r}: a name, or owner/name, of letters, digits, "
            "'.', '_' and '-' (at most 128 each), not starting with '.' or '-'")
    return model_id


def directory_for(models_dir: Path, model_id: str) -> Path:
    """A model's directory: <models_dir>/<id with '/' as '%2F'>.

    One level, and no id can name another's directory ('%' is not allowed in ids).
    """
    path = models_dir / check_model_id(model_id).replace("/", "%2F")
    if path.resolve().parent != models_dir.resolve():
        raise InvalidModelIdError(f"invalid model id {model_id!r}")
    return path


@dataclass(slots=True)
class ModelRecord:
    id: str
    state: str
    model_dir: str | None = None
    name: str = ""  # shown to people; the id's last part unless set
    description: str = ""
    source: str = ""  # what it was pulled from: a directory, a .gguf file or a Hub id
    owned: bool = False  # its files live in the registry and go when it is deleted
    created: int = field(default_factory=lambda: int(time.time()))
    format: str = "safetensors"
    quantization: str = ""
    size_bytes: int = 0
    parameter_count: int = 0  # from its safetensors headers (0: not known)
    settings: dict = field(default_factory=dict)  # how its shard group runs (router.lifecycle.settings)
    parameters: dict = field(default_factory=dict)  # its request defaults
    engine_parameters: dict = field(default_factory=dict)  # chat prompt pieces
    bytes_done: int = 0  # of a download or conversion in progress
    bytes_total: int = 0
    error: str | None = None  # why the last pull or start failed
    was_running: bool = False  # running when the registry was last saved (for --autostart)

    @classmethod
    def from_json(cls, data: dict) -> "ModelRecord":
        """A record read back from the registry file.

        A TypeError or a ValidationError when a hand-edited entry holds what the server would
        trip over later.
        """
        known = {f.name for f in fields(cls)}
        record = cls(**{k: v for k, v in data.items() if k in known})
        for name, kinds in _FIELD_TYPES.items():
            value = getattr(record, name)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise TypeError(f"{record.id!r}: `{name}` holds {type(value).__name__}")
        if record.state not in STATES:
            raise TypeError(f"{record.id!r}: unknown state {record.state!r}")
        record.settings = checked("settings", record.settings, SETTINGS)
        record.parameters = checked("parameters", record.parameters, PARAMETERS)
        record.engine_parameters = checked("engine_parameters", record.engine_parameters,
                                           ENGINE_PARAMETERS)
        return record


_FIELD_TYPES = {
    "id": (str,), "state": (str,), "model_dir": (str, type(None)), "name": (str,),
    "description": (str,), "source": (str,), "owned": (bool,), "created": (int,),
    "format": (str,), "quantization": (str,), "size_bytes": (int,), "parameter_count": (int,), "settings": (dict,),
    "parameters": (dict,), "engine_parameters": (dict,), "bytes_done": (int,),
    "bytes_total": (int,), "error": (str, type(None)), "was_running": (bool,)}


class ModelRegistry:
    def __init__(self, directory: Path | None):
        self.directory = directory  # None: nothing persisted, nothing can be pulled
        self.records: dict[str, ModelRecord] = {}
        self.unavailable: str | None = None  # why this server keeps no registry, when it keeps none
        self._lock_file = None
        if directory is not None and self._lock(directory):
            self._load()
            self._sweep_staging()

    def _lock(self, directory: Path) -> bool:
        """Holds the registry for this server alone: two writing one file would undo each other's.

        A second server on the same directory serves its --model-id without a registry.
        """
        try:
            directory.mkdir(parents=True, exist_ok=True)
            lock_file = open(directory / "lock", "a")  # noqa: SIM115 (held for the process)
        except OSError as err:
            self.unavailable = f"the model registry {directory} cannot be opened: {err}"
        else:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._lock_file = lock_file
                return True
            except OSError:
                lock_file.close()
                self.unavailable = (f"the model registry {directory} belongs to another server "
                                    "running on this machine; give this one its own "
                                    "--model-registry-dir to manage models")
        log.warning("%s", self.unavailable)
        self.directory = None
        return False

    def close(self) -> None:
        """Lets another server take the registry (the lock also goes when the process ends)."""
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    @property
    def models_dir(self) -> Path | None:
        return None if self.directory is None else self.directory / "models"

    @property
    def _file(self) -> Path:
        return self.directory / "models.json"

    def _load(self) -> None:
        try:
            saved = json.loads(self._file.read_text())
            if not isinstance(saved, dict) or not isinstance(saved.get("models", []), list):
                raise ValueError("not a registry")
        except FileNotFoundError:
            return
        except (OSError, ValueError) as err:
            kept = self._file.with_name(f"models.json.unreadable-{int(time.time())}")
            log.error("model registry %s is unreadable (%s); kept as %s, starting with an empty "
                      "one", self._file, err, kept.name)
            self._file.replace(kept)
            return
        for data in saved.get("models", []):
            try:
                record = ModelRecord.from_json(data)
                check_model_id(record.id)
            except (TypeError, AttributeError, RouterError) as err:
                log.warning("skipping a malformed registry entry: %s", err)
                continue
            # what was under way when the last router stopped did not finish
            record.was_running = record.state in (STARTING, RUNNING, STOPPING)
            if record.state == DOWNLOADING:
                record.state, record.error = NOT_DOWNLOADED, "the download was interrupted"
            elif record.state in (STARTING, RUNNING, STOPPING):
                record.state = STOPPED
            self.records[record.id] = record
        self.forget_failed_pulls()

    def _sweep_staging(self) -> None:
        """A pull stopped mid-way (the launcher killed) leaves its staging directory behind."""
        try:
            leftovers = [p for p in self.models_dir.iterdir() if p.name.startswith(".")]
        except OSError:
            return
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)

    def save(self) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        models = []
        for record in self.records.values():
            data = asdict(record)
            data["was_running"] = record.state in (STARTING, RUNNING)
            models.append(data)
        fd, partial = tempfile.mkstemp(prefix=".models-", dir=self.directory)
        with os.fdopen(fd, "w") as out:
            json.dump({"version": 1, "models": models}, out, indent=1)
        os.replace(partial, self._file)

    def get(self, model_id: str) -> ModelRecord:
        record = self.records.get(model_id)
        if record is None:
            raise ModelNotFoundError(f"model {model_id!r} not found")
        return record

    def add(self, record: ModelRecord) -> ModelRecord:
        self.records[record.id] = record
        self.save()
        return record

    def forget_failed_pulls(self, keep: int = MAX_FAILED_PULLS) -> list[str]:
        """Forgets all but the `keep` newest failed pulls (not_downloaded); their ids.

        Newest by the time their pull began, which a pull of the same id again renews."""
        failed = sorted((r for r in self.records.values() if r.state == NOT_DOWNLOADED),
                        key=lambda record: record.created)
        forgotten = [record.id for record in failed[:max(len(failed) - keep, 0)]]
        for model_id in forgotten:
            del self.records[model_id]
        return forgotten

    def remove(self, model_id: str) -> None:
        self.records.pop(model_id, None)
        self.save()

    def move(self, record: ModelRecord, to: str, *, allowed_from: tuple[str, ...],
             action: str) -> None:
        if record.state not in allowed_from:
            raise ModelStateError(f"model {record.id!r} cannot {action}: it is {record.state}",
                                  record.state)
        record.state = to
        self.save()


def parameter_count(model_dir: str | Path) -> int:
    """The weights' element count, Jan's metadata.size ("135M"); 0 when a header cannot be read.

    Read from the safetensors headers (8 bytes of length, then JSON).
    """
    total = 0
    try:
        for path in Path(model_dir).glob("*.safetensors"):
            with open(path, "rb") as weights:
                length = int.from_bytes(weights.read(8), "little")
                if not 0 < length < 100_000_000:
                    return 0
                header = json.loads(weights.read(length))
            for name, tensor in header.items():
                if name != "__metadata__":
                    count = 1
                    for dim in tensor["shape"]:
                        count *= dim
                    total += count
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return total
