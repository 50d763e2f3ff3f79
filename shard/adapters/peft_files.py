"""A LoRA adapter as PEFT saves it: adapter_config.json and adapter_model.safetensors (or .bin).

Read into its per-module lora_A / lora_B pairs and scalings, or refused with the reason."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# PEFT names a saved tensor base_model.model.<module>.lora_A.weight (an adapter name after lora_A
# in some versions' files)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter this server cannot serve on this model; the message says why."""


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


def read_adapter(path: str | Path) -> PeftAdapter:
    """Reads a PEFT LoRA adapter directory; AdapterError for anything missing or unsupported."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"{path}: not a directory")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"{path}: no {CONFIG_FILE} (not a PEFT adapter directory)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise AdapterError(f"{config_path}: not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: not a JSON object")
    _check_config(config, config_path)
    tensors = _read_tensors(directory)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA A or B weight (trained "
                               "embeddings, biases or modules_to_save are not supported)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise AdapterError(f"{path}: the adapter holds no LoRA weights")
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    rslora = bool(config.get("use_rslora"))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{path}: {module} has lora_{next(iter(pair))} but not its pair")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise AdapterError(f"{path}: {module}: lora_A {tuple(a.shape)} and lora_B "
                               f"{tuple(b.shape)} are not a low-rank pair")
        module_rank = a.shape[0]
        expected = _pattern_value(rank_pattern, module, rank)
        if module_rank != int(expected):
            raise AdapterError(f"{path}: {module} has rank {module_rank}, its config says "
                               f"{expected}")
        module_alpha = float(_pattern_value(alpha_pattern, module, alpha))
        scaling = module_alpha / (math.sqrt(module_rank) if rslora else module_rank)
        modules[module] = ModuleUpdate(a, b, scaling)
    kinds = sorted({module.rsplit(".", 1)[-1] for module in modules})
    return PeftAdapter(rank=rank, alpha=alpha,
                       scaling=alpha / (math.sqrt(rank) if rslora else rank),
                       target_modules=kinds,
                       base_model=str(config.get("base_model_name_or_path") or ""),
                       modules=modules)


def _check_config(config: dict, where: Path) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type {peft_type}: only LoRA adapters are served")
    if config.get("use_dora"):
        raise AdapterError(f"{where}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: adapters that train biases (bias={config['bias']!r}) are "
                           "not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save ({config['modules_to_save']}) replaces "
                           "whole modules, which is not supported")
    rank = config.get("r", 8)
    if not isinstance(rank, int) or rank <= 0:
        raise AdapterError(f"{where}: r must be a positive integer, not {rank!r}")
    if not isinstance(config.get("lora_alpha", 8), (int, float)):
        raise AdapterError(f"{where}: lora_alpha must be a number")


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                return load_file(str(path))
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as err:  # a truncated or foreign file: the adapter is refused
            raise AdapterError(f"{path}: cannot be read ({str(err).splitlines()[0][:200]})") from None
        if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor)
                                                   for t in loaded.values()):
            raise AdapterError(f"{path}: not a mapping of tensor names to tensors")
        return loaded
    raise AdapterError(f"{directory}: no {' or '.join(WEIGHT_FILES)}")


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: keys match a module name's end (or as a regex)."""
    for key, value in pattern.items():
        if module == key or module.endswith(f".{key}"):
            return value
        try:
            if re.fullmatch(rf"(.*\.)?{key}", module):
                return value
        except re.error:  # a plain name that is no regular expression
            continue
    return default
