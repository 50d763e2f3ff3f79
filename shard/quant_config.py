"""config.json's quantization_config: which quantized checkpoints the shards serve, and how.

GPTQ, AWQ (GEMM), compressed-tensors (pack-quantized W4A16/W8A16, float-quantized FP8) and FP8
checkpoints, read as TGI and vLLM read them. The launcher checks a checkpoint with this before
any shard starts; the shard reads its tensors by it (shard/layers/checkpoint_formats.py). Must
not import torch (the launcher imports it).
"""
from __future__ import annotations

from dataclasses import dataclass

# TGI's --quantize values that name a checkpoint's own quantization: the methods each accepts
CHECKPOINT_QUANTIZE = {"gptq": ("gptq",), "awq": ("awq",), "marlin": ("gptq", "awq"),
                       "compressed-tensors": ("compressed-tensors",),
                       "fp8": ("fp8",)}
# quant_method of a native GGUF conversion (launcher/gguf.py): its blocks, served as stored
GGUF_METHOD = "gguf"


@dataclass(frozen=True, slots=True)
class CheckpointQuant:
    """How a quantized checkpoint's linear weights are stored."""
    method: str  # "gptq", "awq", "compressed-tensors" (integers), "fp8" (any float8 weights)
    bits: int = 0  # integer formats: 4 or 8
    group_size: int = 0  # inputs per (scale, zero); -1: the whole row
    is_symmetric: bool = True
    has_act_order: bool = False  # GPTQ's desc_act: groups in g_idx's order, not the inputs'
    zeros_plus_one: bool = False  # GPTQ v1 stores each zero minus one
    is_weight_only: bool = True  # False: the checkpoint quantizes activations too (we do not)
    block_size: tuple[int, int] | None = None  # FP8: [rows, columns] of each scale's block

    def summary(self) -> str:
        """For /info and the log, e.g. "gptq 4-bit g128" or "fp8"."""
        if self.method == "fp8":
            # we dequantize weights only: activations stay in the model's dtype
            return "fp8" if self.is_weight_only else "fp8 weights only (activations unquantized)"
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"{self.method} {self.bits}-bit {group}"


def checkpoint_quant(config: dict) -> CheckpointQuant | None:
    """The quantization of a config.json, None where unquantized (or a native GGUF's blocks).

    A ValueError says in one sentence which field of quantization_config cannot be served."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ValueError("quantization_config of config.json is not an object")
    method = str(quant.get("quant_method", "")).lower()
    if method == GGUF_METHOD:
        return None
    reader = _READERS.get(method)
    if reader is None:
        raise ValueError(f"quantization_config.quant_method {method or 'missing'!r} is not served: "
                         f"the quantized checkpoints served are {', '.join(sorted(_READERS))}")
    return reader(quant)


def _field(quant: dict, name: str, allowed: tuple, *names: str):
    value = next((quant[n] for n in (name, *names) if n in quant), None)
    if value not in allowed:
        raise ValueError(f"quantization_config.{name} {value!r} is not served (served: "
                         f"{', '.join(map(str, allowed))})")
    return value


def _gptq(quant: dict) -> CheckpointQuant:
    if quant.get("is_marlin_format"):
        raise ValueError("quantization_config.is_marlin_format true is not served: Marlin's "
                         "repacked layout; serve the GPTQ checkpoint it came from")
    fmt = _field(quant, "checkpoint_format", ("gptq", "gptq_v2", None))
    bits = _field(quant, "bits", (4, 8))
    group = _field(quant, "group_size", (32, 64, 128, -1))
    return CheckpointQuant("gptq", bits, group, bool(quant.get("sym", True)),
                           bool(quant.get("desc_act", False)), zeros_plus_one=fmt != "gptq_v2")


def _awq(quant: dict) -> CheckpointQuant:
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version {version!r} is not served: AWQ's GEMM "
                         "layout is (GEMV and others pack their weights otherwise)")
    if quant.get("zero_point", True) is not True:
        raise ValueError("quantization_config.zero_point false is not served: AWQ GEMM "
                         "checkpoints with zeros are")
    bits = _field(quant, "bits", (4,), "w_bit")
    group = _field(quant, "group_size", (32, 64, 128), "q_group_size")
    return CheckpointQuant("awq", bits, group, is_symmetric=False)


def _fp8(quant: dict) -> CheckpointQuant:
    block = quant.get("weight_block_size")
    if block is not None and (not isinstance(block, list) or len(block) != 2):
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not served: "
                         "[rows, columns] blocks are")
    return CheckpointQuant("fp8", 8, is_weight_only=False,
                           block_size=None if block is None else (int(block[0]), int(block[1])))


def _compressed_tensors(quant: dict) -> CheckpointQuant:
    groups = quant.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups has {len(groups)} groups: "
                         "compressed-tensors checkpoints of one scheme are served")
    group = next(iter(groups.values()))
    fmt = group.get("format") or quant.get("format")
    weights = group.get("weights") or {}
    activations = group.get("input_activations")
    if fmt == "float-quantized":
        _field(weights, "type", ("float",))
        _field(weights, "num_bits", (8,))
        _field(weights, "strategy", ("tensor", "channel"))
        return CheckpointQuant("fp8", 8, is_weight_only=not activations)
    if fmt != "pack-quantized":
        raise ValueError(f"quantization_config.format {fmt!r} is not served: "
                         "pack-quantized (W4A16, W8A16) and float-quantized (FP8) are")
    if activations:
        raise ValueError("quantization_config.config_groups input_activations is not served: "
                         "pack-quantized checkpoints of integer weights alone (W4A16, W8A16) are")
    _field(weights, "type", ("int",))
    bits = _field(weights, "num_bits", (4, 8))
    strategy = _field(weights, "strategy", ("group", "channel"))
    size = -1 if strategy == "channel" else _field(weights, "group_size", (32, 64, 128))
    return CheckpointQuant("compressed-tensors", bits, size,
                           bool(weights.get("symmetric", True)),
                           has_act_order=weights.get("actorder") not in (None, False))


_READERS = {"gptq": _gptq, "awq": _awq, "fp8": _fp8, "fbgemm_fp8": _fp8,
            "compressed-tensors": _compressed_tensors}


def quantize_refusal(quantize: str | None, config: dict) -> str | None:
    """Why --quantize cannot serve a checkpoint of this config.json, or None.

    TGI's checkpoint kinds (gptq, awq, marlin, compressed-tensors, fp8) name the checkpoint's own
    quantization and must match it; tgi-py's int8/int4 quantize an unquantized checkpoint.
    Without --quantize a quantized checkpoint is served as its config says."""
    try:
        quant = checkpoint_quant(config)
    except ValueError as err:
        return f"{err}"
    method = str((config.get("quantization_config") or {}).get("quant_method", "")).lower()
    if quantize is None:
        return None
    if quantize == "fp8" and quant is None and not method:
        return None  # an unquantized checkpoint, quantized to fp8 as it loads (TGI's, too)
    if quantize in CHECKPOINT_QUANTIZE:
        if quant is None:
            has = ("is a GGUF's (its types are served as stored)" if method
                   else "is not in config.json (the checkpoint is unquantized)")
            return (f"--quantize {quantize} serves a checkpoint quantized by {quantize}, but its "
                    f"quantization_config {has}: leave --quantize out, or give int8 or int4 to "
                    "quantize the weights as they load")
        accepted = CHECKPOINT_QUANTIZE[quantize]
        if quant.method not in accepted and method not in accepted:
            return (f"--quantize {quantize}, but the checkpoint's quantization_config."
                    f"quant_method is {method}: give --quantize {_flag_for(quant, method)}, or "
                    "leave --quantize out")
        return None
    if quant is not None or method == GGUF_METHOD:
        return (f"--quantize {quantize} quantizes an unquantized checkpoint, but this one's "
                f"quantization_config.quant_method is {method}: leave --quantize out to serve "
                "it as quantized")
    return None


def _flag_for(quant: CheckpointQuant, method: str) -> str:
    return next((flag for flag, methods in CHECKPOINT_QUANTIZE.items()
                 if method in methods or quant.method in methods), method)
