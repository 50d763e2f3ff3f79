"""A LoRA adapter as PEFT saves it: adapter_config.json and adapter_model.safetensors (or .bin).

Read into its per-module lora_A / lora_B pairs and scalings, or refused with the reason. Each
tensor's name and shape are checked against the model's modules before any tensor is read, and
every size read is bounded, so that a hostile adapter costs little to refuse; the shard reads
adapters off its engine thread (shard/server.py).
"""
from __future__ import annotations

import json
import math
import re
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from shard.adapters.module_patterns import ModulePatterns, PatternError, pattern_budget

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes a few KB (EVA's rank_pattern: some tens)
MAX_HEADER_BYTES = 16 << 20  # a safetensors header: about 150 bytes per tensor
MAX_NAME_CHARS = 1024  # of a tensor (no model's module names come near)
# PEFT names a saved tensor base_model.model.<module>.lora_A.weight (an adapter name after lora_A
# in some versions' files)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
_FLOATS = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "F64": torch.float64}


class AdapterError(ValueError):
    """An adapter this server cannot serve on this model; the message says why."""


@dataclass(frozen=True, slots=True)
class ModuleShape:
    """What a module of the model maps: its full input and output widths."""

    inputs: int
    outputs: int


@dataclass(slots=True)
class ModuleUpdate:
    """One module's low-rank update: out += scaling * B (A x)."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(slots=True)
class PeftAdapter:
    rank: int  # the config's r (modules may have their own: rank_pattern)
    alpha: float
    scaling: float  # of a module of rank r
    target_modules: list[str]  # the module kinds its tensors change (q_proj, ...), sorted
    base_model: str
    modules: dict[str, ModuleUpdate]  # checkpoint module name -> its update


def read_adapter(path: str | Path, modules: Mapping[str, ModuleShape], *,
                 max_rank: int) -> PeftAdapter:
    """Reads a PEFT LoRA adapter directory for a model of `modules`.

    AdapterError for anything missing, unsupported, or that does not fit the model (a module it
    lacks, other widths, a rank over `max_rank`)."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"{path}: not a directory")
    config = _read_config(directory)
    weights = _weight_file(directory)
    shapes, loaded = _tensor_shapes(weights, modules, max_rank)
    pairs = _pairs(path, shapes, modules, max_rank)
    rank, alpha = config.get("r", 8), float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora"))
    budget = pattern_budget()
    try:  # PEFT's per-module rank and alpha, by keys matched in bounded time
        ranks = ModulePatterns(config.get("rank_pattern") or {}, "rank_pattern", budget)
        alphas = ModulePatterns(config.get("alpha_pattern") or {}, "alpha_pattern", budget)
        expected = {module: (ranks.value(module, rank), float(alphas.value(module, alpha)))
                    for module in pairs}
    except PatternError as err:
        raise AdapterError(f"{path}: {err}") from None
    tensors = loaded if loaded is not None else _read_tensors(weights, shapes)
    updates = {}
    for module, (a_key, b_key) in pairs.items():
        module_rank = shapes[a_key][0][0]
        config_rank, module_alpha = expected[module]
        if module_rank != config_rank:
            raise AdapterError(f"{path}: {module} has rank {module_rank}, its config says "
                               f"{config_rank}")
        scaling = module_alpha / (math.sqrt(module_rank) if rslora else module_rank)
        updates[module] = ModuleUpdate(tensors[a_key], tensors[b_key], scaling)
    kinds = sorted({module.rsplit(".", 1)[-1] for module in updates})
    return PeftAdapter(rank=rank, alpha=alpha,
                       scaling=alpha / (math.sqrt(rank) if rslora else rank),
                       target_modules=kinds,
                       base_model=_text(config.get("base_model_name_or_path") or ""),
                       modules=updates)


def _read_config(directory: Path) -> dict:
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"{directory}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        if config_path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(f"{config_path}: over {MAX_CONFIG_BYTES} bytes, which no PEFT "
                               "config is")
        config = json.loads(config_path.read_bytes())
    except (OSError, ValueError, RecursionError) as err:
        if isinstance(err, AdapterError):
            raise
        raise AdapterError(f"{config_path}: not readable JSON ({str(err)[:200]})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: not a JSON object")
    _check_config(config, config_path)
    return config


def _check_config(config: dict, where: Path) -> None:
    peft_type = str(config.get("peft_type", "LORA"))[:64].upper()
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type!r}: only LoRA adapters are served")
    if config.get("use_dora"):
        raise AdapterError(f"{where}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: adapters that train biases (bias="
                           f"{str(config['bias'])[:64]!r}) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save ({str(config['modules_to_save'])[:200]}) "
                           "replaces whole modules, which is not supported")
    if not _is_rank(config.get("r", 8)):
        raise AdapterError(f"{where}: r must be a positive integer, not "
                           f"{str(config.get('r'))[:64]}")
    if not _is_number(config.get("lora_alpha", 8)):
        raise AdapterError(f"{where}: lora_alpha must be a finite number")
    for name, is_value in (("rank_pattern", _is_rank), ("alpha_pattern", _is_number)):
        pattern = config.get(name) or {}
        if not isinstance(pattern, dict):
            raise AdapterError(f"{where}: {name} must be an object of module names or patterns "
                               "to values")
        bad = next((key for key, value in pattern.items() if not is_value(value)), None)
        if bad is not None:
            raise AdapterError(f"{where}: {name}[{str(bad)[:200]!r}] must be "
                               f"{'a positive integer' if name == 'rank_pattern' else 'a number'}")


def _is_rank(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _weight_file(directory: Path) -> Path:
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise AdapterError(f"{directory}: no {' or '.join(WEIGHT_FILES)}")


def largest_weights_bytes(modules: Mapping[str, ModuleShape], max_rank: int) -> int:
    """The most bytes a LoRA adapter's weights file can hold for these modules, up to `max_rank`.

    Every module's A and B at that rank in float64 (the widest float a file may hold), and 1 MiB
    for a file format's own bytes."""
    return sum(8 * max_rank * (m.inputs + m.outputs) for m in modules.values()) + (1 << 20)


def _tensor_shapes(weights: Path, modules: Mapping[str, ModuleShape], max_rank: int
                   ) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]],
                              dict[str, torch.Tensor] | None]:
    """Each tensor's shape and dtype, read from the safetensors header alone.

    A .bin file is a pickle, read whole to see them: it must be no larger, unpacked, than the
    largest adapter the model takes (then also returned, read)."""
    try:
        if weights.suffix == ".safetensors":
            with open(weights, "rb") as file:
                (header_bytes,) = struct.unpack("<Q", file.read(8).ljust(8, b"\0"))
            if header_bytes > MAX_HEADER_BYTES:
                raise AdapterError(f"{weights}: a header of {header_bytes} bytes; a LoRA "
                                   f"adapter's is far under {MAX_HEADER_BYTES}")
            shapes = {}
            with safe_open(str(weights), framework="pt") as file:
                keys = file.keys()
                if len(keys) > 2 * len(modules):
                    raise AdapterError(f"{weights}: {len(keys)} tensors; a LoRA adapter of this "
                                       f"model has at most {2 * len(modules)}")
                for key in keys:
                    piece = file.get_slice(key)
                    dtype = _FLOATS.get(piece.get_dtype())
                    if dtype is None:
                        raise AdapterError(f"{weights}: tensor '{_shown(key)}' holds "
                                           f"{piece.get_dtype()}, not floats")
                    shapes[key] = (tuple(piece.get_shape()), dtype)
            return shapes, None
        largest = largest_weights_bytes(modules, max_rank)
        size = weights.stat().st_size
        if zipfile.is_zipfile(weights):  # torch.save's format: what its entries unpack to
            with zipfile.ZipFile(weights) as archive:
                size = max(size, sum(entry.file_size for entry in archive.infolist()))
        if size > largest:
            raise AdapterError(f"{weights}: {size} bytes, more than any LoRA adapter of rank up "
                               f"to {max_rank} on this model holds")
        loaded = torch.load(str(weights), map_location="cpu", weights_only=True)
    except AdapterError:
        raise
    except MemoryError:
        raise
    except Exception as err:  # a truncated or foreign file: the adapter is refused
        raise AdapterError(f"{weights}: cannot be read ({_first_line(err)})") from None
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                               and t.is_floating_point()
                                               for k, t in loaded.items()):
        raise AdapterError(f"{weights}: not a mapping of tensor names to float tensors")
    return {k: (tuple(t.shape), t.dtype) for k, t in loaded.items()}, loaded


def _pairs(path, shapes: dict, modules: Mapping[str, ModuleShape], max_rank: int
           ) -> dict[str, tuple[str, str]]:
    """module -> its (lora_A, lora_B) tensor names, each checked against the module's widths."""
    found: dict[str, dict[str, str]] = {}
    for key, (shape, _) in shapes.items():
        match = _KEY.match(key) if len(key) <= MAX_NAME_CHARS else None
        if match is None:
            raise AdapterError(f"{path}: tensor '{_shown(key)}' is not a LoRA A or B weight "
                               "(trained embeddings, biases or modules_to_save are not "
                               "supported)")
        module = match["module"]
        if module not in modules:
            kinds = sorted({name.rsplit(".", 1)[-1] for name in modules})
            raise AdapterError(f"{path}: it changes {_shown(module)}, which is not a projection "
                               f"of this model that adapters may change ({', '.join(kinds)} of "
                               "its layers)")
        if len(shape) != 2:
            raise AdapterError(f"{path}: '{_shown(key)}' has {len(shape)} dimensions, not 2")
        found.setdefault(module, {})[match["which"]] = key
    if not found:
        raise AdapterError(f"{path}: the adapter holds no LoRA weights")
    pairs = {}
    for module, pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} has lora_{next(iter(pair))} but not its pair")
        (rank, inputs), (outputs, b_rank) = shapes[pair["A"]][0], shapes[pair["B"]][0]
        if b_rank != rank or rank < 1:
            raise AdapterError(f"{path}: {module}: lora_A {(rank, inputs)} and lora_B "
                               f"{(outputs, b_rank)} are not a low-rank pair")
        if rank > max_rank:
            raise AdapterError(f"{path}: {module} has rank {rank}; ranks up to {max_rank} are "
                               "served")
        expected = modules[module]
        if (inputs, outputs) != (expected.inputs, expected.outputs):
            raise AdapterError(
                f"{path}: {module} maps {inputs} inputs to {outputs} outputs in the adapter but "
                f"{expected.inputs} to {expected.outputs} in this model: the adapter was trained "
                "on another base model")
        pairs[module] = (pair["A"], pair["B"])
    return pairs


def _read_tensors(weights: Path, shapes: dict) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(weights), framework="pt") as file:
            return {key: file.get_tensor(key) for key in shapes}
    except MemoryError:
        raise
    except Exception as err:  # checked above: only a file changed or cut meanwhile gets here
        raise AdapterError(f"{weights}: cannot be read ({_first_line(err)})") from None


def _first_line(err: BaseException) -> str:
    lines = str(err).splitlines()
    return (lines[0] if lines else type(err).__name__)[:200]


def _shown(name: str) -> str:
    """A tensor or module name as a message shows it: escaped, and cut short when long."""
    text = repr(name[:200])[1:-1]
    return text if len(name) <= 200 else f"{text}... ({len(name)} characters)"


def _text(value) -> str:
    """A config string as a reply carries it: UTF-8 (no lone surrogate), at most 1024 characters."""
    return str(value)[:1024].encode("utf-8", "backslashreplace").decode("utf-8")
