"""Quantized checkpoints made on the fly, packed and dequantized as each format's spec says.

Written from the formats' own code, not from the shard's loader: AutoGPTQ's QuantLinear.pack
(qweight along inputs, qzeros along outputs, zeros stored minus one in v1), AutoAWQ's
WQLinear_GEMM.from_linear (along outputs in the order 0, 2, 4, 6, 1, 3, 5, 7) and
compressed-tensors' pack_to_int32 (offset codes, lowest bits first). numpy, one value at a time
where the spec is a loop, so a shared mistake with the loader's vectorised reading is unlikely.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Case:
    """A weight [out, in] as codes q (unsigned), zeros [groups, out], fp16 scales [groups, out]."""
    q: np.ndarray  # [out, in] uint
    zeros: np.ndarray  # [groups, out] uint
    scales: np.ndarray  # [groups, out] float16
    g_idx: np.ndarray  # [in] group of each input


def random_case(rng, out: int, inputs: int, *, bits: int, group: int, sym: bool = False,
                act_order: bool = False) -> Case:
    size = inputs if group == -1 else group
    groups = inputs // size
    g_idx = np.arange(inputs) // size
    if act_order:  # GPTQ's desc_act: group i // size of the i-th input in a permuted order
        g_idx = np.empty(inputs, dtype=np.int64)
        g_idx[rng.permutation(inputs)] = np.arange(inputs) // size
    top = (1 << bits) - 1
    zeros = (np.full((groups, out), 1 << (bits - 1)) if sym
             else rng.integers(0, top + 1, (groups, out)))
    scales = (rng.random((groups, out)) * 0.02 + 1e-3).astype(np.float16)
    return Case(rng.integers(0, top + 1, (out, inputs)), zeros, scales, g_idx)


def reference(case: Case) -> np.ndarray:
    """w[o, i] = scales[g, o] * (q[o, i] - zeros[g, o]), g = g_idx[i], in float32."""
    g = case.g_idx
    return (case.scales.astype(np.float32)[g].T
            * (case.q - case.zeros[g].T).astype(np.float32)).astype(np.float32)


def _words(values: np.ndarray, bits: int) -> np.ndarray:
    """Rows of values -> int32 words along the first axis, value j of word i at bit bits * j."""
    per = 32 // bits
    words = np.zeros((values.shape[0] // per, *values.shape[1:]), dtype=np.uint32)
    for row in range(words.shape[0]):
        for j in range(per):
            words[row] |= values[row * per + j].astype(np.uint32) << np.uint32(bits * j)
    return words.view(np.int32)


def pack_gptq(case: Case, bits: int, *, v1: bool = True, with_g_idx: bool = True) -> dict:
    """AutoGPTQ's tensors: qweight [in/per, out], qzeros [groups, out/per], scales, g_idx."""
    zeros = case.zeros - 1 if v1 else case.zeros  # v1 stores zeros minus one (mod 2 ** bits)
    zeros = zeros & ((1 << bits) - 1)
    tensors = {"qweight": _words(case.q.T, bits), "qzeros": _words(zeros.T, bits).T.copy(),
               "scales": case.scales}
    if with_g_idx:
        tensors["g_idx"] = case.g_idx.astype(np.int32)
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}


def _awq_words(values: np.ndarray) -> np.ndarray:
    """[rows, out] 4-bit values -> [rows, out / 8] words, AutoAWQ's order within each."""
    words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for col in range(words.shape[1]):
        for i in range(8):
            words[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def pack_awq(case: Case) -> dict:
    """AutoAWQ GEMM's tensors: qweight [in, out/8], qzeros [groups, out/8], scales."""
    return {"qweight": torch.from_numpy(_awq_words(case.q.T)),
            "qzeros": torch.from_numpy(_awq_words(case.zeros)),
            "scales": torch.from_numpy(case.scales)}


def pack_to_int32(signed: np.ndarray, bits: int, packed_dim: int = 1) -> np.ndarray:
    """compressed-tensors' pack_to_int32: value + 2 ** (bits - 1), packed along `packed_dim`."""
    codes = (signed + (1 << (bits - 1))).astype(np.uint32)
    if packed_dim == 0:
        return _words(codes, bits)
    return _words(codes.T, bits).T.copy()


def pack_compressed(case: Case, bits: int, *, sym: bool, with_g_idx: bool = False,
                    scale_dtype=np.float16) -> dict:
    """weight_packed [out, in/per], weight_scale [out, groups], weight_zero_point (asym)."""
    offset = 1 << (bits - 1)
    tensors = {"weight_packed": pack_to_int32(case.q.astype(np.int64) - offset, bits),
               "weight_scale": case.scales.T.astype(scale_dtype),
               "weight_shape": np.array(case.q.shape, dtype=np.int64)}
    if not sym:
        tensors["weight_zero_point"] = pack_to_int32(case.zeros.T.astype(np.int64) - offset,
                                                     bits, packed_dim=0)
    if with_g_idx:
        tensors["weight_g_idx"] = case.g_idx.astype(np.int32)
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}


def _unpacked(words: torch.Tensor, bits: int, *, along_rows: bool) -> np.ndarray:
    """int32 words -> values, value j of each word at bit bits * j, along rows or columns."""
    stored = words.numpy().view(np.uint32)
    per, mask = 32 // bits, np.uint32((1 << bits) - 1)
    if along_rows:
        values = np.zeros((stored.shape[0] * per, stored.shape[1]), dtype=np.int64)
        for j in range(per):
            values[j::per] = (stored >> np.uint32(bits * j)) & mask
    else:
        values = np.zeros((stored.shape[0], stored.shape[1] * per), dtype=np.int64)
        for j in range(per):
            values[:, j::per] = (stored >> np.uint32(bits * j)) & mask
    return values


def reference_gptq(t: dict, bits: int, *, group: int, v1: bool = True) -> np.ndarray:
    """AutoGPTQ's dequantization: scales[g_idx] * (weight - (zeros + 1 in v1)[g_idx]), [out, in]."""
    weight = _unpacked(t["qweight"], bits, along_rows=True)  # [in, out]
    zeros = _unpacked(t["qzeros"], bits, along_rows=False) + (1 if v1 else 0)
    inputs = weight.shape[0]
    g_idx = (t["g_idx"].numpy().astype(np.int64) if "g_idx" in t
             else np.arange(inputs) // (inputs if group == -1 else group))
    scales = t["scales"].numpy().astype(np.float32)
    return (scales[g_idx] * (weight - zeros[g_idx]).astype(np.float32)).T.copy()


def reference_awq(t: dict, *, group: int) -> np.ndarray:
    """AutoAWQ's dequantization: (q - z) * s with its order within each word, [out, in]."""
    def unpack(words):
        stored = words.numpy().view(np.uint32)
        values = np.zeros((stored.shape[0], stored.shape[1] * 8), dtype=np.int64)
        for col in range(stored.shape[1]):
            for i in range(8):
                values[:, col * 8 + AWQ_ORDER[i]] = (stored[:, col] >> np.uint32(4 * i)) & 15
        return values
    weight, zeros = unpack(t["qweight"]), unpack(t["qzeros"])
    g = np.arange(weight.shape[0]) // group
    scales = t["scales"].numpy().astype(np.float32)
    return (scales[g] * (weight - zeros[g]).astype(np.float32)).T.copy()


def reference_compressed(t: dict, bits: int, *, group: int) -> np.ndarray:
    """compressed-tensors' unpack_from_int32 then (q - zero_point) * scale, [out, in]."""
    offset = 1 << (bits - 1)
    q = _unpacked(t["weight_packed"], bits, along_rows=False) - offset
    inputs = q.shape[1]
    zero = (_unpacked(t["weight_zero_point"], bits, along_rows=True) - offset
            if "weight_zero_point" in t else np.zeros((q.shape[0], 1), dtype=np.int64))
    g_idx = (t["weight_g_idx"].numpy().astype(np.int64) if "weight_g_idx" in t
             else np.arange(inputs) // (inputs if group == -1 else group))
    scale = t["weight_scale"].float().numpy()
    zero = zero[:, g_idx] if zero.shape[1] > 1 or "weight_zero_point" in t else zero
    return (scale[:, g_idx] * (q - zero).astype(np.float32)).astype(np.float32)


def write(directory: Path, tensors: dict, quantization_config: dict | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def quantized_model(source: Path, quantized: Path, reference_dir: Path, *, method: str,
                    bits: int = 4, group: int = 32, act_order: bool = False,
                    seed: int = 0) -> None:
    """`source`'s linear weights quantized by `method` into `quantized`, and its weights with
    those replaced by their reference dequantization (float32) into `reference_dir`.

    `method`: gptq, awq or compressed-tensors (pack-quantized, asymmetric). A Mixture-of-Experts
    model's experts are quantized one by one, as the Hub stores them (experts.{e}.gate_proj)."""
    rng = np.random.default_rng(seed)
    tensors = load_file(str(source / "model.safetensors"))
    quant, dequantized = {}, {}
    for name, weight in tensors.items():
        prefix = name.removesuffix(".weight")
        if prefix.rsplit(".", 1)[-1] not in LINEARS:
            quant[name] = dequantized[name] = weight.float()
            continue
        case = _fit(weight.float().numpy(), rng, bits=bits, group=group, act_order=act_order)
        if method == "gptq":
            packed = pack_gptq(case, bits)
            values = reference_gptq(packed, bits, group=group)
        elif method == "compressed-tensors":
            packed = pack_compressed(case, bits, sym=False)
            values = reference_compressed(packed, bits, group=group)
        else:
            packed = pack_awq(case)
            values = reference_awq(packed, group=group)
        quant.update({f"{prefix}.{k}": v for k, v in packed.items()})
        dequantized[name] = torch.from_numpy(values)
    for directory, saved in ((quantized, quant), (reference_dir, dequantized)):
        directory.mkdir(parents=True, exist_ok=True)
        save_file(saved, str(directory / "model.safetensors"))
        for extra in source.iterdir():
            if extra.suffix != ".safetensors":
                shutil.copy(extra, directory / extra.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _quantization_config(method, bits, group, act_order)
    (quantized / "config.json").write_text(json.dumps(config))


def _quantization_config(method: str, bits: int, group: int, act_order: bool) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order,
                "sym": False, "checkpoint_format": "gptq"}
    if method == "compressed-tensors":
        weights = {"num_bits": bits, "type": "int", "symmetric": False, "strategy": "group",
                   "group_size": group}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm"}


def _fit(weight: np.ndarray, rng, *, bits: int, group: int, act_order: bool) -> Case:
    """Codes, zeros and scales near `weight` (round to nearest per group, asymmetric)."""
    out, inputs = weight.shape
    case = random_case(rng, out, inputs, bits=bits, group=group, act_order=act_order)
    top = (1 << bits) - 1
    for g in range(case.scales.shape[0]):
        members = case.g_idx == g
        lo = np.minimum(weight[:, members].min(axis=1), 0)
        hi = np.maximum(weight[:, members].max(axis=1), 0)
        scale = np.maximum((hi - lo) / top, 1e-4).astype(np.float16)
        zero = np.clip(np.round(-lo / scale.astype(np.float32)), 1, top)  # v1 cannot store 0
        case.scales[g], case.zeros[g] = scale, zero
        codes = np.round(weight[:, members] / scale.astype(np.float32)[:, None]) + zero[:, None]
        case.q[:, members] = np.clip(codes, 0, top)
    return case
