"""LoRA adapters: --lora-adapters' entries (TGI's syntax) resolved to local directories.

Each entry is resolved to a local directory holding PEFT's adapter_config.json and
adapter_model.safetensors (or .bin); the module also builds the router's argument naming them.

An entry is `id` (a local directory, or a Hub id downloaded, those two files alone, into the
Hugging Face cache as a Hub model is: launcher/resolve.py), `id@revision` (a Hub id at that
revision) or `name=path` (a local directory served under `name`). The name of an `id` entry is the
id itself, as in TGI: what requests give as their adapter_id.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from launcher.model_cache import ModelResolutionError
from router.config.server import adapter_name_problem

ADAPTER_CONFIG = "adapter_config.json"
# PEFT's weight files, in the order they are taken: safetensors where a source has both
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
FLAG = "--lora-adapters"
_LOCAL_PREFIXES = ("/", "./", "../", "~")  # an entry that starts so is never a Hub id


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str  # what a request names it by (adapter_id, OpenAI's model, SGLang's lora_path)
    source: str  # a local directory or a Hub id
    revision: str | None = None  # of a Hub id
    is_local: bool = False  # given as name=path: a directory, never looked up on the Hub


def parse_lora_adapters(text: str | None, *, model_id: str) -> list[AdapterSpec]:
    """The flag's comma-separated entries, in order; ValueError names the flag and the fault.

    `model_id`: the base model's served name, which no adapter may take (OpenAI's `model` names
    either)."""
    if text is None or not text.strip():
        return []
    specs = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            raise ValueError(f"{FLAG} {text!r} has an empty entry (two commas in a row, or one at "
                             "an end); give `id`, `id@revision` or `name=path` between commas")
        specs.append(_parse_entry(entry))
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"{FLAG} names the adapter {spec.name!r} twice; each name is one "
                             "adapter: serve the other under `othername=path`")
        if spec.name == model_id:
            raise ValueError(f"{FLAG}: the adapter name {spec.name!r} is the model's own "
                             "(--model-id), which requests use for the base model; give the "
                             "adapter another with `name=path`")
        seen.add(spec.name)
    return specs


def _parse_entry(entry: str) -> AdapterSpec:
    if "=" in entry:  # a name holds no '=': the path is all that follows the first one
        name, path = (part.strip() for part in entry.split("=", 1))
        if not name:
            raise ValueError(f"{FLAG} entry {entry!r} has an empty name before '='; write "
                             "`name=path`")
        if not path:
            raise ValueError(f"{FLAG} entry {entry!r} has an empty path after '='; write "
                             "`name=path` with the adapter's local directory")
        spec = AdapterSpec(name, path, is_local=True)
    elif "@" in entry:
        source, revision = (part.strip() for part in entry.rsplit("@", 1))
        if not source or not revision:
            raise ValueError(f"{FLAG} entry {entry!r}: write `id@revision`, with a Hub id and a "
                             "branch, tag or commit")
        spec = AdapterSpec(source, source, revision)
    else:
        spec = AdapterSpec(entry, entry)
    if any(c.isspace() for c in spec.name):
        raise ValueError(f"{FLAG}: the adapter name {spec.name!r} holds a space; requests name "
                         "adapters by it, so give one without")
    problem = adapter_name_problem(spec.name)  # the router's rule, said before any shard starts
    if problem is not None:
        raise ValueError(f"{FLAG}: {problem}")
    return spec


def adapter_files(path: Path) -> list[Path]:
    """[adapter_config.json, the weights file] of an adapter directory.

    Or the error naming what it lacks."""
    config = path / ADAPTER_CONFIG
    if not config.is_file():
        raise ModelResolutionError(f"{path} holds no {ADAPTER_CONFIG}: not a PEFT LoRA adapter")
    weights = next((path / name for name in ADAPTER_WEIGHTS if (path / name).is_file()), None)
    if weights is None:
        raise ModelResolutionError(f"LoRA adapter {path} holds neither "
                                   f"{' nor '.join(ADAPTER_WEIGHTS)}")
    return [config, weights]


def is_hub_source(spec: AdapterSpec) -> bool:
    """Whether the adapter comes from the Hub: neither a directory nor spelled as a path."""
    return not (spec.is_local or spec.source.startswith(_LOCAL_PREFIXES)
                or Path(spec.source).expanduser().is_dir())


def resolve_adapter(spec: AdapterSpec, *, hub_cache: str | None = None,
                    max_bytes: int = 0) -> Path:
    """The absolute local directory of one adapter, downloading a Hub id's two files first.

    `max_bytes` (0: no bound): a Hub adapter whose files hold more is refused before either is
    downloaded."""
    if is_hub_source(spec):
        directory = download_adapter(spec.source, spec.revision, hub_cache, max_bytes)
    else:
        path = Path(spec.source).expanduser()
        if not path.is_dir():
            raise ModelResolutionError(f"LoRA adapter {spec.name}: directory {path} does not "
                                       "exist")
        if spec.revision:
            raise ModelResolutionError(f"LoRA adapter {spec.name}: {spec.source} is a local "
                                       f"directory, and @{spec.revision} a Hub revision; give "
                                       "the directory alone")
        directory = path.resolve()
    adapter_files(directory)
    return directory


def resolve_adapters(specs: list[AdapterSpec], *, hub_cache: str | None = None) -> dict[str, Path]:
    """{name: directory}, in the flag's order."""
    directories = {}
    for spec in specs:
        directory = resolve_adapter(spec, hub_cache=hub_cache)
        if "," in str(directory):  # the router's list is comma-separated
            raise ModelResolutionError(f"LoRA adapter {spec.name}: its directory {directory} "
                                       "holds a ',', which the router's list cannot carry; "
                                       "move it (or the Hub cache) to a path without one")
        directories[spec.name] = directory
    return directories


def router_adapters_argv(directories: dict[str, Path]) -> list[str]:
    """The router's `--lora-adapters name=/abs/dir,...` argument.

    The router splits it on ',', then each entry on its FIRST '=' (names hold none; a path may)."""
    if not directories:
        return []
    return [FLAG, ",".join(f"{name}={directory}" for name, directory in directories.items())]


def download_adapter(repo_id: str, revision: str | None, hub_cache: str | None,
                     max_bytes: int = 0) -> Path:
    """The snapshot directory of a Hub adapter's files, downloaded into the Hugging Face cache.

    The Hub repository's adapter_config.json and adapter_model.safetensors (else .bin), nothing
    else, and with `max_bytes` only when the Hub lists them at no more. HF_TOKEN and HF_HUB_OFFLINE
    act as for a model (huggingface_hub reads them): offline, only the cache answers."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError

    def fetch(name: str) -> Path:
        return Path(hf_hub_download(repo_id, name, revision=revision, cache_dir=hub_cache))

    try:
        if max_bytes and not constants.HF_HUB_OFFLINE:
            _check_hub_sizes(repo_id, revision, max_bytes)
        try:
            config = fetch(ADAPTER_CONFIG)
        except RemoteEntryNotFoundError:
            raise ModelResolutionError(f"Hub repository {repo_id!r} holds no {ADAPTER_CONFIG}: "
                                       "not a PEFT LoRA adapter") from None
        missing = []
        for name in ADAPTER_WEIGHTS:
            try:
                fetch(name)
                return config.parent
            except EntryNotFoundError as err:  # not in the repository, or offline and not cached
                missing.append(err)
        offline = not all(isinstance(err, RemoteEntryNotFoundError) for err in missing)
        raise ModelResolutionError(
            f"Hub LoRA adapter {repo_id!r}: neither {' nor '.join(ADAPTER_WEIGHTS)} "
            + ("is in the Hugging Face cache, and the Hub cannot be reached" if offline
               else "is in the repository"))
    except ModelResolutionError:
        raise
    except Exception as err:  # offline, unknown repo, no network: all end the same way for a user
        reason = (str(err).strip().splitlines() or [""])[0]
        raise ModelResolutionError(
            f"LoRA adapter {repo_id!r} is neither a local directory nor an adapter the Hugging "
            f"Face Hub could provide ({type(err).__name__}: {reason}). With HF_HUB_OFFLINE=1 only "
            "adapters already in the Hugging Face cache can be used.") from None


def _check_hub_sizes(repo_id: str, revision: str | None, max_bytes: int) -> None:
    """ModelResolutionError when the files download_adapter would fetch hold over `max_bytes`.

    The sizes are the Hub's listing, read before anything is fetched: a repository with a huge
    weights file costs one listing to refuse, not the disk it would fill."""
    from huggingface_hub import HfApi

    sizes = {entry.path: getattr(entry, "size", 0) or 0
             for entry in HfApi().list_repo_tree(repo_id, revision=revision)}
    weights = next((sizes[name] for name in ADAPTER_WEIGHTS if name in sizes), 0)
    total = sizes.get(ADAPTER_CONFIG, 0) + weights
    if total > max_bytes:
        raise ModelResolutionError(
            f"Hub LoRA adapter {repo_id!r}: its files hold {total} bytes, more than any LoRA "
            f"adapter this model takes ({max_bytes} bytes at the highest rank); nothing was "
            "downloaded")
