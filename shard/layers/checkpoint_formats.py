"""Reading a quantized checkpoint's linear weight, or this rank's rows or columns of it.

Each format's tensors for a layer prefix, read as far as the rows (outputs) and columns (inputs)
asked for, into shard/layers/checkpoint_quants.py's forms:
- GPTQ: qweight int32 [in * bits / 32, out] packed along inputs (value j of word i is input
  (32 / bits) * i + j, at bit bits * j), qzeros int32 [groups, out * bits / 32] packed along
  outputs, scales fp16 [groups, out], g_idx [in]; v1 checkpoints store each zero minus one.
- AWQ (GEMM): qweight int32 [in, out / 8] and qzeros [groups, out / 8] packed along outputs in
  the order 0, 2, 4, 6, 1, 3, 5, 7; scales fp16 [groups, out].
- compressed-tensors pack-quantized: weight_packed int32 [out, in * bits / 32] packed along
  inputs, lowest bits first, offset by 2 ** (bits - 1); weight_scale [out, groups];
  weight_zero_point (asymmetric) packed along outputs the same way; weight_g_idx (act order).
- FP8: weight float8 [out, in] with weight_scale (or weight_scale_inv) per tensor, per row, or
  per block of weight_block_size.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from shard.layers.checkpoint_quants import FloatRows, QuantizedRows, integer_rows
from shard.quant_config import CheckpointQuant

# AWQ's packing puts output k of each word at nibble _AWQ_NIBBLE[k]
_AWQ_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]
_FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
_NAMES = {"gptq": "GPTQ", "awq": "AWQ", "compressed-tensors": "CT"}

View = Callable[[str], object]  # tensor name -> its safetensors slice


def stored_prefix(quant: CheckpointQuant, name: str, has: Callable[[str], bool],
                  dtype_of: Callable[[str], str]) -> str | None:
    """The layer prefix of `name` ("<prefix>.weight") where the checkpoint stores it quantized."""
    if not name.endswith(".weight"):
        return None
    prefix = name.removesuffix(".weight")
    if quant.method in ("gptq", "awq"):
        return prefix if has(f"{prefix}.qweight") else None
    if quant.method == "compressed-tensors":
        return prefix if has(f"{prefix}.weight_packed") else None
    return prefix if has(name) and dtype_of(name) in _FP8_DTYPES else None


def stored_shape(quant: CheckpointQuant, view: View, prefix: str) -> list[int]:
    """[out, in] of the layer's weight."""
    if quant.method == "gptq":
        packed, out = view(f"{prefix}.qweight").get_shape()
        return [out, packed * 32 // quant.bits]
    if quant.method == "awq":
        inputs, packed = view(f"{prefix}.qweight").get_shape()
        return [packed * 8, inputs]
    if quant.method == "compressed-tensors":
        out, packed = view(f"{prefix}.weight_packed").get_shape()
        return [out, packed * 32 // quant.bits]
    return list(view(f"{prefix}.weight").get_shape())


def read_stored(quant: CheckpointQuant, view: View, has: Callable[[str], bool], prefix: str,
                rows: slice, columns: tuple[int, int] | None) -> QuantizedRows | FloatRows:
    """The layer's weight rows `rows` (outputs) and `columns` (inputs; None: all), as stored."""
    out, inputs = stored_shape(quant, view, prefix)
    r0, r1, _ = rows.indices(out)
    c0, c1 = columns or (0, inputs)
    reader = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed}.get(quant.method,
                                                                                 _fp8)
    return reader(quant, view, has, prefix, (r0, r1), (c0, c1), inputs)


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits values of `bits` bits each, lowest first, along `dim`."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    moved = words.to(torch.int32).movedim(dim, -1)
    values = (moved[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*moved.shape[:-1], -1).movedim(-1, dim)


def _packed_range(view, start: int, stop: int, per_word: int, dim: int, other: slice,
                  bits: int, nibbles: list[int] | None = None) -> torch.Tensor:
    """Values [start, stop) along `dim` of a tensor packed along it, `other` along the other dim."""
    first, last = start // per_word, -(-stop // per_word)
    words = view[first:last, other] if dim == 0 else view[other, first:last]
    values = _unpack(words, bits, dim)
    if nibbles is not None:  # AWQ's order within each word
        values = values.reshape(*values.shape[:-1], -1, 8)[..., nibbles].flatten(-2)
    offset = start - first * per_word
    return values.narrow(dim, offset, stop - start)


def _group_ids(view, has, name: str | None, columns: tuple[int, int], size: int) -> torch.Tensor:
    """Each input's group: the checkpoint's g_idx where it has one, else input // size."""
    if name is not None and has(name):
        return view(name)[columns[0]:columns[1]].long()
    inputs = torch.arange(*columns)
    return torch.zeros_like(inputs) if size == -1 else inputs // size


def _kind(quant: CheckpointQuant) -> str:
    group = "channel" if quant.group_size == -1 else f"g{quant.group_size}"
    return f"{_NAMES[quant.method]}-{quant.bits}bit-{group}"


def _gptq(quant, view, has, prefix, rows, columns, inputs):
    bits, per_word = quant.bits, 32 // quant.bits
    q = _packed_range(view(f"{prefix}.qweight"), *columns, per_word, 0, slice(*rows), bits).T
    ids = _group_ids(view, has, f"{prefix}.g_idx", columns, quant.group_size)
    g0, g1 = int(ids.min()), int(ids.max()) + 1  # the groups these inputs belong to
    scale = view(f"{prefix}.scales")[g0:g1, rows[0]:rows[1]].float().T
    zero = _packed_range(view(f"{prefix}.qzeros"), *rows, per_word, 1, slice(g0, g1), bits).T
    if quant.zeros_plus_one:
        zero = zero + 1
    return integer_rows(_kind(quant), bits, q, scale.contiguous(), zero, ids - g0)


def _awq(quant, view, has, prefix, rows, columns, inputs):
    q = _packed_range(view(f"{prefix}.qweight"), *rows, 8, 1, slice(*columns), 4,
                      _AWQ_NIBBLE).T
    ids = _group_ids(view, has, None, columns, quant.group_size)
    g0, g1 = int(ids.min()), int(ids.max()) + 1
    scale = view(f"{prefix}.scales")[g0:g1, rows[0]:rows[1]].float().T
    zero = _packed_range(view(f"{prefix}.qzeros"), *rows, 8, 1, slice(g0, g1), 4,
                         _AWQ_NIBBLE).T
    return integer_rows(_kind(quant), 4, q, scale.contiguous(), zero, ids - g0)


def _compressed(quant, view, has, prefix, rows, columns, inputs):
    bits, per_word = quant.bits, 32 // quant.bits
    offset = 1 << (bits - 1)  # the codes of signed values
    q = _packed_range(view(f"{prefix}.weight_packed"), *columns, per_word, 1, slice(*rows), bits)
    ids = _group_ids(view, has, f"{prefix}.weight_g_idx", columns, quant.group_size)
    g0, g1 = int(ids.min()), int(ids.max()) + 1
    scale = view(f"{prefix}.weight_scale")[rows[0]:rows[1], g0:g1].float()
    name = f"{prefix}.weight_zero_point"
    if quant.is_symmetric or not has(name):
        zero = torch.full_like(scale, offset)
    elif view(name).get_dtype() == "I32":  # packed along outputs
        zero = _packed_range(view(name), *rows, per_word, 0, slice(g0, g1), bits)
    else:  # older files: signed values, unpacked
        zero = view(name)[rows[0]:rows[1], g0:g1].long() + offset
    return integer_rows(_kind(quant), bits, q, scale.contiguous(), zero, ids - g0)


def _fp8(quant, view, has, prefix, rows, columns, inputs):
    """FP8 values with their scale per tensor, row, or block, as a float32 scale per group."""
    data = view(f"{prefix}.weight")[rows[0]:rows[1], columns[0]:columns[1]]
    name = next(n for n in (f"{prefix}.weight_scale_inv", f"{prefix}.weight_scale") if has(n))
    scale = view(name)[...].float()  # [...]: a per-tensor scale may be 0-dimensional
    width = columns[1] - columns[0]
    if scale.numel() == 1:
        return FloatRows("FP8-tensor", data, scale.reshape(1, 1).expand(len(data), 1).clone(),
                         width)
    if scale.dim() == 1 or scale.shape[1] == 1:
        return FloatRows("FP8-channel", data, scale.reshape(-1, 1)[rows[0]:rows[1]].clone(),
                         width)
    out = stored_shape(quant, view, prefix)[0]
    block_rows, block_columns = quant.block_size or (-(-out // scale.shape[0]),
                                                     -(-inputs // scale.shape[1]))
    per_row = scale[torch.arange(*rows) // block_rows]  # [rows, column blocks]
    # groups that tile both the blocks and this rank's first column
    group = math.gcd(block_columns, columns[0])
    per_group = per_row.repeat_interleave(block_columns // group, dim=1)
    first = columns[0] // group
    return FloatRows(f"FP8-block{block_rows}x{block_columns}", data,
                     per_group[:, first:first - (-width // group)].contiguous(), group)
