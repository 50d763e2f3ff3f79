"""A decode step of Llama's layer as one C call on the CPU (shard/kernels/decode_step.c).

It calls the kernels the eager forward calls, in its order on its inputs, so its logits are the
eager step's bit for bit without the Python and dispatch around them, LoRA adapters' updates
included (shard/kernels/lora.c, the eager layers' kernel). It sees a model only through the
DecodeLayout its family declares (shard.models.decode_layout). Where it does not apply
`unsupported_reason` says why; TGI_PY_DECODE_STEP=0 switches it off.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from shard.adapters.adapter_set import AdapterSet
from shard.kernels import (bf16_matmul, int4_matmul, int8_matmul, layer_ops, lora, native,
                           paged_attention)
from shard.layers.attention_state import LayerCache
from shard.models.decode_layout import DecodeLayout

SOURCE = native.KERNELS / "decode_step.c"
FLAGS = ["-O2", "-shared", "-fPIC"]
ENABLED_ENV = "TGI_PY_DECODE_STEP"

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Kernels(ctypes.Structure):
    _fields_ = [("rms_norm", _ptr), ("silu_mul", _ptr), ("rotary_store", _ptr),
                ("attention", _ptr), ("lora_add", _ptr), ("rotary_store_int8", _ptr),
                ("attention_int8", _ptr)]


class _Linear(ctypes.Structure):
    _fields_ = [("matmul", _ptr), ("weight", _ptr), ("bias", _ptr)]


class _LoraPart(ctypes.Structure):
    _fields_ = [("a", _ptr), ("bt", _ptr), ("ranks", _ptr), ("num_slots", _i64),
                ("max_rank", _i64), ("offset", _i64), ("width", _i64)]


# each projection's first entry in a layer's LoRA parts (decode_step.c's LORA_*) and its room
_LORA_ROOM = {"qkv_proj": (0, 3), "o_proj": (3, 1), "gate_up_proj": (4, 2), "down_proj": (6, 1)}
_LORA_PARTS = 7


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("key_cache", _ptr),
                ("value_cache", _ptr), ("lora", _LoraPart * _LORA_PARTS), ("key_scale", _ptr),
                ("value_scale", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64),
                ("head_dim", _i64), ("intermediate", _i64), ("vocab_rows", _i64),
                ("num_blocks", _i64), ("block_size", _i64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("final_norm", _ptr), ("lm_head", _Linear),
                ("layer", ctypes.POINTER(_Layer)), ("kv_int8", _i64)]


_BUFFERS = ("residual0", "residual1", "normed", "qkv", "qk", "attention", "projected", "gate_up",
            "act")


class _Buffers(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in _BUFFERS]


@functools.cache
def load_library() -> ctypes.CDLL | None:
    library = native.load_library(SOURCE, FLAGS, ENABLED_ENV,
                                  "decode steps run layer by layer from Python")
    if library is None:
        return None
    library.decode_step.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Model),
                                    ctypes.POINTER(_Buffers), _i64, _ptr, _ptr, _ptr, _ptr, _ptr,
                                    _ptr, _i64, _ptr, _ptr, _ptr, _ptr]
    library.decode_step.restype = ctypes.c_int
    return library


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def unsupported_reason(layout: DecodeLayout, cache: list[LayerCache]) -> str | None:
    """Why a model's decode step, as its family declares it, cannot run in C here, or None.

    It runs where the model computes Llama's layer and every piece of the eager step is one of
    our kernels: a bf16 model, a bf16 or int8 KV cache, on a CPU whose build has all of them, one
    rank, no PyTorch quantized kernels, no bias after a row-parallel projection, no sliding
    window."""
    departures = layout.departures()
    if departures:
        return (f"{layout.family} computes {', '.join(departures)} (the C loop computes Llama's "
                "layer)")
    if any(layer.window is not None for layer in layout.layers):
        return "its layers attend over a sliding window (Mistral's), the C loop over whole contexts"
    if layout.activation_dtype != torch.bfloat16:
        return f"activations are {layout.activation_dtype}, not bf16"
    if not cache or any(c.key.dtype not in (torch.bfloat16, torch.int8)
                        or c.key.device.type != "cpu"
                        or not c.key.is_contiguous() or not c.value.is_contiguous()
                        or (c.is_int8 and not (c.key_scale.is_contiguous()
                                               and c.value_scale.is_contiguous()))
                        for c in cache):
        return "the KV cache is not a contiguous bf16 or int8 CPU cache"
    if layout.lm_head.parallel.is_sharded:
        return "tensor-parallel ranks all-reduce between the kernels"
    eps = layout.final_norm.eps
    for layer in layout.layers:
        if layer.input_norm.eps != eps or layer.post_attention_norm.eps != eps:
            return "the norms' epsilons differ (the C loop takes one)"
        if layer.o_proj.bias is not None or layer.down_proj.bias is not None:
            return "a bias after a row-parallel projection is a separate bf16 add in eager steps"
        for linear, (_, room) in zip(layer.projections, _LORA_ROOM.values()):
            source = linear.lora_source
            if source is not None and len(source.parts) > room:
                return (f"a projection computes {len(source.parts)} checkpoint modules that "
                        f"adapters may change (the C loop takes {room})")
    linears = [layout.lm_head] + [p for layer in layout.layers for p in layer.projections]
    if any(c_matmul(linear.prepared) is None for linear in linears):
        return ("a linear layer runs another kernel than our C bf16, int4 or int8 matmuls "
                "(PyTorch's quantized kernels, a GGUF's blocks dequantized per layer, inputs "
                "permuted for act-order groups, an odd input width, or a CPU where ours do not "
                "run: AMX, AVX-512 without BF16, no AVX2)")
    for name, library in (("the fused layer ops", layer_ops.load_library()),
                          ("the attention kernel", paged_attention.load_kernel()),
                          ("the decode step", load_library())):
        if library is None:
            return f"{name} did not build or is switched off"
    return None


class DecodeStep:
    """Runs decode steps of one model over one KV cache pool (a new pool needs a new DecodeStep).

    `adapters` are the LoRA adapters loaded on the model, whose updates rows may ask for."""

    def __init__(self, layout: DecodeLayout, cache: list[LayerCache], adapters: AdapterSet):
        first = layout.layers[0]
        self.layout = layout
        self.adapters = adapters
        self.heads, self.kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.hidden = layout.hidden_size
        self.intermediate = first.down_proj.prepared.in_features
        self.vocab_rows = layout.lm_head.prepared.out_features
        self.block_size = cache[0].key.shape[2]
        layers = []
        for layer, layer_cache in zip(layout.layers, cache):
            qkv, o, gate_up, down = (_linear(linear.prepared) for linear in layer.projections)
            layers.append(_Layer(
                layer.input_norm.weight.data_ptr(), layer.post_attention_norm.weight.data_ptr(),
                qkv, o, gate_up, down, layer_cache.key.data_ptr(), layer_cache.value.data_ptr(),
                key_scale=_pointer(layer_cache.key_scale),
                value_scale=_pointer(layer_cache.value_scale)))
        self._layers = (_Layer * len(layers))(*layers)
        self._cache = cache  # the pointers above stay valid while the pool lives
        norm = layout.final_norm
        self._model = _Model(
            len(layers), self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
            self.vocab_rows, cache[0].key.shape[0], self.block_size, norm.eps, first.scale,
            norm.weight.data_ptr(), _linear(layout.lm_head.prepared), self._layers,
            int(cache[0].is_int8))
        ops = layer_ops.load_library()
        self._kernels = _Kernels(
            _address(ops.rms_norm), _address(ops.silu_mul), _address(ops.rotary_store),
            _address(paged_attention.load_kernel().paged_decode_attention),
            _address(lora.load_library().lora_add) if lora.load_library() is not None else None,
            _address(ops.rotary_store_int8),
            _address(paged_attention.load_kernel().paged_decode_attention_int8))
        # whether steps with LoRA adapters can run here (the eager layers' PyTorch path otherwise)
        self.takes_adapters = self._kernels.lora_add is not None
        self._lora_version: int | None = None  # the adapter set's version the parts were set for
        self._lora_parts: list = []  # what the parts' pointers point into
        d = self.head_dim
        # the widths of the step's activations, in _BUFFERS' order, laid end to end in one scratch
        # row block per batch row: each buffer starts at batch * (the widths before it)
        widths = [self.hidden, self.hidden, self.hidden, (self.heads + 2 * self.kv_heads) * d,
                  (self.heads + self.kv_heads) * d, self.heads * d, self.hidden,
                  2 * self.intermediate, self.intermediate]
        self._starts = [sum(widths[:i]) for i in range(len(widths))]
        self._scratch_width = sum(widths)
        self._run = load_library().decode_step

    def __call__(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
                 block_tables: torch.Tensor, row_slots: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per sequence at position seq_lens -> (logits, final hidden states).

        Logits [B, vocab] float32 and the final normed hidden states [B, hidden], as the eager
        step returns them; row i with the update of LoRA slot row_slots[i] of the model's
        adapters (-1: none), rotated as `positions` where given (multimodal rotary ones)."""
        batch = input_ids.shape[0]
        # the C loop reads `batch` entries of each through raw pointers
        if (input_ids.dim() != 1 or seq_lens.shape != (batch,) or block_tables.dim() != 2
                or block_tables.shape[0] != batch or block_tables.shape[1] == 0):
            raise ValueError(f"decode step: {tuple(input_ids.shape)} tokens, {tuple(seq_lens.shape)} "
                             f"positions and {tuple(block_tables.shape)} block tables disagree")
        embeds = self.layout.embed(input_ids).contiguous()
        angles = self.layout.rotary(seq_lens if positions is None else positions)
        cos, sin = angles.cos.contiguous(), angles.sin.contiguous()
        tables = block_tables.to(torch.int64).contiguous()
        seq_lens = seq_lens.to(torch.int64)
        context_lens = (seq_lens + 1).contiguous()
        slot_blocks = tables.gather(1, (seq_lens // self.block_size).unsqueeze(1)).squeeze(1)
        slot_blocks = slot_blocks.contiguous()
        slot_offsets = (seq_lens % self.block_size).contiguous()
        self.follow_adapters()
        slots = None if row_slots is None else self._lora_slots(row_slots, batch)
        scratch = torch.empty(batch * self._scratch_width, dtype=torch.bfloat16)
        base, row = scratch.data_ptr(), batch * scratch.element_size()
        buffers = _Buffers(*(base + row * start for start in self._starts))
        hidden = torch.empty(batch, self.hidden, dtype=torch.bfloat16)
        logits = torch.empty(batch, self.vocab_rows, dtype=torch.bfloat16)
        status = self._run(
            ctypes.byref(self._kernels), ctypes.byref(self._model),
            ctypes.byref(buffers), batch, embeds.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), slot_blocks.data_ptr(), slot_offsets.data_ptr(),
            tables.data_ptr(), tables.stride(0), context_lens.data_ptr(), hidden.data_ptr(),
            logits.data_ptr(), None if slots is None else slots.data_ptr())
        if status == -1:
            raise IndexError("a KV slot lies outside the cache")
        if status != 0:
            raise MemoryError("decode attention, a matmul or a LoRA update could not allocate its "
                              "scratch buffers")
        return logits[:, : self.layout.lm_head.vocab_size].float(), hidden

    def _lora_slots(self, row_slots: torch.Tensor, batch: int) -> torch.Tensor | None:
        """row_slots as the C loop reads them (int64 [batch]).

        None where no layer holds an adapter's update."""
        if not self._lora_parts:
            return None
        if not self.takes_adapters:
            raise RuntimeError("LoRA updates need the C LoRA kernel in the C decode step (it did "
                               "not build or is switched off): run such steps eagerly")
        if row_slots.shape != (batch,):
            raise ValueError(f"decode step: {tuple(row_slots.shape)} adapter slots for {batch} "
                             "rows")
        return row_slots.to(torch.int64).contiguous()

    def follow_adapters(self) -> None:
        """The layers' LoRA parts set again after every load and unload of an adapter.

        Every step looks: after the last unload, the freed stacks are let go even if no adapter
        row ever comes."""
        if self.adapters.version != self._lora_version:
            self._set_lora_parts()
            self._lora_version = self.adapters.version

    def _set_lora_parts(self) -> None:
        """Every layer's LoRA parts from its projections' `.lora` (a LoraTarget or None)."""
        d = self.head_dim
        q_width, qkv_width = self.heads * d, (self.heads + 2 * self.kv_heads) * d
        # each projection's (inputs, outputs), in _LORA_ROOM's order
        shapes = ((self.hidden, qkv_width), (q_width, self.hidden),
                  (self.hidden, 2 * self.intermediate), (self.intermediate, self.hidden))
        held = []
        for layer, entry in zip(self.layout.layers, self._layers):
            for linear, (first, room), shape in zip(layer.projections, _LORA_ROOM.values(),
                                                    shapes):
                target = linear.lora
                parts = [] if target is None else target.parts
                assert len(parts) <= room, "unsupported_reason refuses more parts"
                for index in range(room):
                    part = parts[index] if index < len(parts) else None
                    entry.lora[first + index] = _lora_part(part, *shape)
                    if part is not None and part.a.numel() > 0:
                        held.append((part.a, part.bt, part.ranks))
        self._lora_parts = held


def _lora_part(part, inputs: int, outputs: int) -> _LoraPart:
    """A LoraPart of a projection of `inputs` -> `outputs` features as the C loop reads it.

    An empty entry for None or stacks without room; ValueError where its tensors do not fit the
    pointers the loop follows."""
    if part is None or part.a.numel() == 0:
        return _LoraPart()
    a, bt, ranks = part.a, part.bt, part.ranks
    if (a.dtype != torch.bfloat16 or bt.dtype != torch.bfloat16 or ranks.dtype != torch.int64
            or not (a.is_contiguous() and bt.is_contiguous() and ranks.is_contiguous())
            or a.dim() != 3 or a.shape[2] != inputs
            or bt.shape != (a.shape[0], a.shape[1], part.width) or ranks.shape != a.shape[:1]
            or part.offset < 0 or part.offset + part.width > outputs):
        raise ValueError(f"LoRA part {part.name}: a {a.dtype} {tuple(a.shape)}, bt {bt.dtype} "
                         f"{tuple(bt.shape)}, ranks {ranks.dtype} {tuple(ranks.shape)}, columns "
                         f"{part.offset}..{part.offset + part.width} do not fit a projection of "
                         f"{inputs} -> {outputs} features")
    return _LoraPart(a.data_ptr(), bt.data_ptr(), ranks.data_ptr(), a.shape[0], a.shape[1],
                     part.offset, part.width)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def c_matmul(prepared) -> tuple[int, torch.Tensor] | None:
    """(the address of our C matmul for a layer's weight form, that form), or None.

    None where the layer runs another kernel (PyTorch's quantized ones, a GGUF's blocks
    dequantized per layer, float copies on CPUs where our matmuls do not run), or permutes its
    inputs first (a GPTQ act-order checkpoint's input_order), which the C loop does not."""
    if prepared.quantized_rows or prepared.input_order is not None:
        return None
    if prepared.int4_form is not None:
        return _address(int4_matmul.load_library().int4_matmul), prepared.int4_form
    if prepared.int8_form is not None:
        return _address(int8_matmul.load_library().int8_matmul), prepared.int8_form
    if prepared.tiled is not None:
        library = bf16_matmul.load_library()
        return None if library is None else (_address(library.bf16_matmul), prepared.tiled)
    return None


def _linear(prepared) -> _Linear:
    """A layer as the C loop multiplies by it (unsupported_reason has checked it has a form)."""
    matmul, form = c_matmul(prepared)
    bias = None if prepared.tiled_bias is None else prepared.tiled_bias.data_ptr()
    return _Linear(matmul, form.data_ptr(), bias)
