"""A check at start that Triton's CUDA kernels compile and answer as PyTorch does for this model.

The kernels' numerics are tested under Triton's interpreter on CPUs, which cannot check what only a
card does: the compilation for this model's head size, grouping and dtype (bf16 products
included), and the card's resources. Each kernel the model would run is called once on small
random inputs of the model's shapes and compared with float32 attention in PyTorch; a kernel that
raises or answers otherwise is not used (decode_backend.refuse_triton), and the shard serves
through PyTorch's paths, saying why in its log.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = 0.05  # bf16 products against float32 ones: far under a broken kernel's errors
_BLOCKS = 3  # cache blocks of one sequence: its context spans every one


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What a model's attention layers compile Triton's kernels for."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    windowed: bool
    softcap: float | None


def attention_shapes(model: torch.nn.Module) -> list[AttentionShape]:
    """The distinct shapes of the model's attention layers, from its decode layout.

    Empty where its family declares none: `problem` then checks one of grouped queries."""
    declare = getattr(model, "decode_layout", None)
    layout = declare() if declare is not None else None
    if layout is None or not layout.layers:
        return []
    return sorted({AttentionShape(layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                  layer.window is not None, layout.attention_softcap)
                   for layer in layout.layers}, key=repr)


def problem(shapes: list[AttentionShape], block_size: int, dtype: torch.dtype, int8: bool,
            device: torch.device) -> str | None:
    """Why Triton's kernels cannot serve these shapes on `device`, or None when each agrees."""
    from shard.kernels import triton_attention, triton_layer_ops, triton_prefill

    generator = torch.Generator(device="cpu").manual_seed(0)
    for shape in shapes or [AttentionShape(8, 2, 64, False, None)]:
        where = (f"{shape.num_heads} heads over {shape.num_kv_heads}, head size "
                 f"{shape.head_dim}, {str(dtype).removeprefix('torch.')}"
                 + (", int8 cache" if int8 else ""))
        try:
            found = _attention_error(shape, block_size, dtype, int8, device, generator,
                                     triton_attention, triton_prefill)
            found = found or _norm_error(shape.num_heads * shape.head_dim, dtype, device,
                                         generator, triton_layer_ops)
        except Exception as err:  # noqa: BLE001 (a compiler's or a launch's failure: any kind)
            return f"{where}: {type(err).__name__}: {str(err).strip()[:300]}"
        if found:
            return f"{where}: {found}"
    return None


def _random(shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def _attention_error(shape: AttentionShape, block_size: int, dtype: torch.dtype, int8: bool,
                     device: torch.device, generator: torch.Generator, decode_kernel,
                     prefill_kernel) -> str | None:
    heads, kv_heads, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    context = _BLOCKS * block_size - 1
    keys = _random((_BLOCKS, kv_heads, block_size, d), generator, torch.float32, device)
    values = _random((_BLOCKS, kv_heads, block_size, d), generator, torch.float32, device)
    options = {"window": block_size + 1 if shape.windowed else None, "softcap": shape.softcap}
    if int8:  # a scale per token and head, as kv_int8 stores them
        key_scales = keys.abs().amax(-1) / 127
        value_scales = values.abs().amax(-1) / 127
        key_cache = torch.round(keys / key_scales[..., None]).to(torch.int8)
        value_cache = torch.round(values / value_scales[..., None]).to(torch.int8)
        keys, values = key_cache.float() * key_scales[..., None], \
            value_cache.float() * value_scales[..., None]
        options.update(key_scales=key_scales, value_scales=value_scales)
    else:
        key_cache, value_cache = keys.to(dtype), values.to(dtype)
        keys, values = key_cache.float(), value_cache.float()
    table = torch.arange(_BLOCKS, device=device).flip(0)  # blocks out of order, as a pool has them
    scale = d ** -0.5
    # every key as the sequence's positions 0 .. context - 1
    flat_keys = keys[table].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :context]
    flat_values = values[table].permute(1, 0, 2, 3).reshape(kv_heads, -1, d)[:, :context]
    q = _random((4, heads, d), generator, dtype, device)  # the last 4 positions' queries
    expected = _reference(q.float(), flat_keys, flat_values, context - 4, scale, **{
        k: options[k] for k in ("window", "softcap")})
    for splits in (1, 2):  # one program a row, then its blocks shared
        got = decode_kernel.paged_decode_attention(
            q[-1:], key_cache, value_cache, table[None], torch.tensor([context], device=device),
            scale, splits=splits, **options)
        error = (got.float().view(1, heads, d) - expected[-1:]).abs().max().item()
        if not error <= TOLERANCE:
            return f"decode attention ({splits} program(s) a row) is off by {error:.3g}"
    got = prefill_kernel.paged_prefill_attention(q, key_cache, value_cache, table[None], [0, 4],
                                                 [context - 4], [0], scale, **options)
    error = (got.float().view(4, heads, d) - expected).abs().max().item()
    if not error <= TOLERANCE:
        return f"prefill attention over a cached prefix is off by {error:.3g}"
    return None


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int, scale: float,
               window: int | None, softcap: float | None) -> torch.Tensor:
    """Float32 attention of queries at positions first, first + 1, ... over keys [kv, L, d]."""
    group = q.shape[1] // keys.shape[0]
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
    scores = torch.einsum("thd,hld->thl", q, keys) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    position = torch.arange(first, first + q.shape[0], device=q.device)[:, None, None]
    key_position = torch.arange(keys.shape[1], device=q.device)
    hidden = key_position > position
    if window is not None:
        hidden |= key_position <= position - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("thl,hld->thd", scores.softmax(-1), values)


def _norm_error(width: int, dtype: torch.dtype, device: torch.device, generator: torch.Generator,
                layer_ops) -> str | None:
    x, residual = (_random((3, width), generator, dtype, device) for _ in range(2))
    summed = x.float() + residual.float()
    for scale_wide in (False, True):  # Llama's norm, then Gemma's (a float32 weight)
        weight = _random((width,), generator, torch.float32 if scale_wide else dtype, device)
        fused = layer_ops.rms_norm(x, weight, 1e-6, residual, scale_wide=scale_wide)
        if fused is None:  # a shape the fused op leaves to PyTorch
            continue
        expected = weight.float() * summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True)
                                                         + 1e-6)
        error = (fused[0].float() - expected).abs().max().item()
        if not error <= TOLERANCE * expected.abs().max().item():
            form = "Gemma's" if scale_wide else "Llama's"
            return f"the fused residual add and RMS norm ({form}) is off by {error:.3g}"
    return None
