"""Linear layers that know which slice of a checkpoint tensor belongs to this rank.

Column-parallel layers split the output features and need no communication; row-parallel layers split
the input features and sum the partial products across ranks.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shard.distributed import ParallelContext, all_reduce
from shard.kernels import bf16_matmul, int4_matmul, int8_matmul
from shard.layers import fp8, int8_dynamic
from shard.layers.checkpoint_quants import same_order
from shard.layers.ggml_quants import BlockRows, BlockStack, join_rows
from shard.layers.kernel_forms import kernel_form
from shard.layers.lora import CheckpointPart, LoraSource, LoraTarget
from shard.layers.precision import c_matmul_runs, cpu_has_bf16_kernels
from shard.layers.quantize import QuantizedWeight, c_int4, can_quantize, quantize, quantized_linear
from shard.weights import Weights

# fbgemm's float16 GEMM is deprecated in favour of torch.ao's wrappers around the same kernel
warnings.filterwarnings("ignore", message="fbgemm_linear_fp16_weight")

# Up to this many rows, fbgemm's half-precision-weight GEMM (weights read once, float32 arithmetic)
# beats float32 MKL on AVX2 CPUs; prefill-size matmuls run faster in float32.
HALF_WEIGHT_MAX_ROWS = 48
# One row is a matrix-vector product, which PyTorch runs on the bf16 weight itself faster than
# fbgemm's half-precision path.
BF16_GEMV_MAX_ROWS = 1
# The int8/int4 kernels take their activations in bf16 (float32 ones fall back to far slower code).
# Reading a quarter or an eighth of the bytes wins while a matmul is bound by reading its weight: up
# to a few rows, on a CPU with bf16 kernels (not on AVX2 alone). Where they do not pay, the quantized
# layers multiply by the weights their quantized forms stand for, in the forms above.
QUANTIZED_KERNEL_DTYPE = torch.bfloat16
QUANTIZED_MAX_ROWS = 4


def c_int4_runs() -> bool:
    """Whether int4 layers of a bf16 model take our C int4 kernel here (AVX-512 BF16 or AVX2 form).

    It runs alone: it multiplies decode-size batches by the 4-bit form and larger ones by our bf16
    matmul's tiles over blocks it unpacks. Where our bf16 matmul does not run (AMX, AVX-512
    without BF16, TGI_PY_MATMUL_KERNEL=0), neither does it: oneDNN's kernels were not measured
    against those tiles there."""
    return int4_matmul.load_library() is not None and c_matmul_runs()


def c_int8_runs() -> bool:
    """Whether a GGUF's 5-, 6- and 8-bit types take our C int8 kernel here (as c_int4_runs)."""
    return int8_matmul.load_library() is not None and c_matmul_runs()


def quantized_kernel_rows() -> int:
    """Up to how many rows a layer quantized for PyTorch's kernels runs them on this CPU (0: never).

    Never without bf16 kernels (they do not pay there), nor where the C bf16 matmul runs (int4
    layers of bf16 models take our own int4 kernel there instead, c_int4_runs): PyTorch's int8
    kernel is slower than it, and its int4 kernel, though faster per matmul, keeps the step in
    Python, which costs more than that against the C decode step. Also where the C step does not
    apply (tensor parallel, --compile-decode, a row-parallel bias): decided per layer at load
    time, this gives up int4's per-matmul gain there."""
    if not cpu_has_bf16_kernels() or c_matmul_runs():
        return 0
    return QUANTIZED_MAX_ROWS


@dataclass(slots=True)
class LinearWeight:
    """A weight [out_features, in_features] (and bias) in the form this CPU multiplies fastest.

    The form is chosen once by `prepare`: our C kernels' `tiled` or int4 `quantized` forms,
    oneDNN's `packed` layout, float copies (`half`, `widened`) where bf16 arithmetic is emulated,
    PyTorch's int8/int4 `quantized` kernels for small batches, else `weight` as stored (float32,
    and every GPU). A packed or quantized form replaces the checkpoint's layout (`weight` None),
    which would double the layer's memory."""

    out_features: int
    in_features: int
    weight: torch.Tensor | None = None  # where a path multiplies by the checkpoint's layout
    bias: torch.Tensor | None = None
    tiled: torch.Tensor | None = None
    tiled_bias: torch.Tensor | None = None  # bias as bf16, for our C kernels
    packed: torch.Tensor | None = None
    half: torch.Tensor | None = None
    widened: torch.Tensor | None = None
    wide_bias: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None
    quantized_rows: int = 0  # PyTorch's quantized kernels run for up to this many rows
    # a GGUF's blocks (or a quantized checkpoint's groups) where no kernel of ours takes them:
    # dequantized at every call
    blocks: BlockStack | None = None
    block_kinds: tuple[str, ...] = ()  # the GGUF types (or checkpoint kinds) it came in
    # the inputs in the quantized form's column order (a GPTQ act-order checkpoint's groups made
    # consecutive): x's columns are taken in this order at every call; None: as they come
    input_order: torch.Tensor | None = None

    @property
    def form(self) -> str:
        """What the layer multiplies by, for logs: "int4", "int8", "blocks" or the dtype."""
        if self.blocks is not None:
            return "blocks"
        if self.quantized is not None:
            return self.quantized.kind
        return str(self.weight.dtype if self.weight is not None else torch.bfloat16
                   ).removeprefix("torch.")

    @property
    def int4_form(self) -> torch.Tensor | None:
        """The weight in our C int4 kernel's form, where the layer holds that alone."""
        quantized = self.quantized
        return quantized.data if quantized is not None and quantized.kernel == "c" else None

    @property
    def int8_form(self) -> torch.Tensor | None:
        """The weight in our C int8 kernel's grouped form, where the layer holds that alone."""
        quantized = self.quantized
        return quantized.data if quantized is not None and quantized.kernel == "c8" else None

    @property
    def multiplies_quantized(self) -> bool:
        """Whether some batch size multiplies by the quantized form (not the weights it stands for)."""
        return (self.int4_form is not None or self.int8_form is not None
                or (self.quantized is not None
                    and (self.quantized_rows > 0 or self.quantized.kernel in ("fp8", "fbgemm"))))

    @classmethod
    def prepare(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                quantize_kind: str | None = None, model_dtype: torch.dtype | None = None
                ) -> "LinearWeight":
        """The weight in its fastest form on this device.

        `model_dtype`: what the model holds weights in, when `weight` arrives as stored to be
        quantized. A GGUF's blocks take our kernel for their types (from_blocks)."""
        if not isinstance(weight, torch.Tensor):  # a GGUF's or a quantized checkpoint's rows
            return cls.from_blocks(weight, bias, model_dtype)
        shape = {"out_features": weight.shape[0], "in_features": weight.shape[1]}
        if quantize_kind == int8_dynamic.KIND:  # an encoder's int8: the bias packed inside
            packed = int8_dynamic.pack(weight, bias)
            return cls(**shape, quantized=QuantizedWeight(
                "int8", packed, None, weight.shape[0], torch.float32, kernel="fbgemm"))
        if quantize_kind == "fp8":  # on any device; a shape the scaled matmul refuses stays
            if not fp8.can_quantize(weight):
                return cls.prepare(weight, bias, model_dtype=model_dtype)
            data, scales = fp8.quantize_rows(weight)
            return cls(**shape, bias=bias, quantized=QuantizedWeight(
                "fp8", data, scales, weight.shape[0], torch.float32, kernel="fp8"))
        if quantize_kind and weight.device.type == "cpu" and can_quantize(weight, quantize_kind):
            if (quantize_kind == "int4" and (model_dtype or weight.dtype) == torch.bfloat16
                    and c_int4_runs()):  # our int4 kernel takes every batch size: its form alone
                return cls(**shape, bias=bias, tiled_bias=_bf16(bias), quantized=c_int4(weight))
            quantized, restored = quantize(weight, quantize_kind, QUANTIZED_KERNEL_DTYPE)
            prepared = cls.prepare(restored.to(model_dtype or weight.dtype), bias)
            prepared.quantized_rows = quantized_kernel_rows()
            if not prepared.quantized_rows:  # never multiplied by here: not held
                quantized.data = quantized.scales = None
            prepared.quantized = quantized
            return prepared
        if model_dtype is not None:
            weight = weight.to(model_dtype)
        if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
            return cls(**shape, weight=weight, bias=bias)  # F.linear, pinned to transformers'
        if c_matmul_runs() and bf16_matmul.can_pack(weight):  # faster than oneDNN at decode sizes
            return cls(**shape, bias=bias, tiled=bf16_matmul.pack(weight),
                       tiled_bias=_bf16(bias))
        if cpu_has_bf16_kernels():  # the layout F.linear would reorder the weight into every call
            return cls(**shape, bias=bias,
                       packed=torch.ops.mkldnn._reorder_linear_weight(weight, 32))
        # PyTorch emulates bf16 arithmetic here: float32 arithmetic on the same values (the models
        # hold float32 activations then), through fbgemm's float16 form for decode-size batches
        # (bf16 -> fp16 keeps these values up to a negligible error)
        widened = weight.float()
        wide_bias = (bias.float() if bias is not None
                     else torch.zeros(weight.shape[0], dtype=torch.float32))
        return cls(**shape, weight=weight, bias=bias, half=fbgemm_half_layout(widened),
                   widened=widened, wide_bias=wide_bias)


    @classmethod
    def from_blocks(cls, weight: BlockRows | BlockStack, bias: torch.Tensor | None = None,
                    model_dtype: torch.dtype | None = None) -> "LinearWeight":
        """A GGUF's blocks (or a quantized checkpoint's groups) in our kernel's form, exactly.

        In a bf16 model on the CPU, where our kernels run, and where every part takes its inputs
        in one order (act-order parts of a fused projection may not): 4-bit parts (Q4_0, Q4_1,
        Q4_K; GPTQ, AWQ, compressed-tensors at 4 bits) take the C int4 kernel's form when their
        groups tile into 32 inputs, and the other integer grids (GGUF's 5-, 6- and 8-bit types,
        8-bit checkpoints, a fused projection mixing them with 4-bit parts) the C int8 kernel's
        (groups of 16 or 32), a GGUF's in its own factors where they fit (kernel_forms).
        Elsewhere (FP8, float32 models, CUDA, CPUs without our kernels) the parts are held as
        stored and dequantized a layer at a time."""
        stack = weight if isinstance(weight, BlockStack) else BlockStack((weight,))
        shape = {"out_features": stack.rows, "in_features": stack.columns}
        kinds = stack.kinds
        order = input_order(stack)
        kernels = (stack.parts[0].data.device.type == "cpu" and order is not False
                   and (model_dtype or torch.bfloat16) == torch.bfloat16)
        form = kernel_form(stack, int4=kernels and c_int4_runs(),
                           int8=kernels and c_int8_runs()) if kernels else None
        if form is None:
            return cls(**shape, bias=bias, blocks=stack, block_kinds=kinds)
        return cls(**shape, bias=bias, tiled_bias=_bf16(bias), quantized=form, block_kinds=kinds,
                   input_order=order)


def input_order(stack: BlockStack) -> torch.Tensor | None | bool:
    """The parts' common order of inputs (None: as they come), False where they differ."""
    orders = [getattr(part, "input_order", None) for part in stack.parts]
    first = orders[0]
    if any(not same_order(order, first) for order in orders[1:]):
        return False
    return first


def _bf16(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.to(torch.bfloat16).contiguous()


def fbgemm_half_layout(weight: torch.Tensor) -> torch.Tensor | None:
    """fbgemm's packed float16 form of a float32 weight, or None without fbgemm (non-x86 builds)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated in favour of torch.ao, same kernel
        try:
            return torch.fbgemm_pack_gemm_matrix_fp16(weight)
        except (AttributeError, RuntimeError):
            return None


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    if w.blocks is not None:  # in the checkpoint's order of inputs
        return F.linear(x, w.blocks.dequantize(x.dtype), w.bias)
    if w.input_order is not None:
        x = x.index_select(-1, w.input_order)
    if w.quantized is not None and w.quantized.kernel == "fp8":
        return fp8.linear(x, w.quantized.data, w.quantized.scales, w.bias)
    if w.quantized is not None and w.quantized.kernel == "fbgemm":
        return int8_dynamic.linear(x, w.quantized.data)
    int4_form = w.int4_form
    if int4_form is not None:  # the bias inside, in float32
        return int4_matmul.matmul(x, int4_form, w.out_features, w.tiled_bias)
    int8_form = w.int8_form
    if int8_form is not None:
        return int8_matmul.matmul(x, int8_form, w.out_features, w.tiled_bias)
    if w.quantized is not None and x.shape[0] <= w.quantized_rows:
        out = quantized_linear(x, w.quantized)
        return out if w.bias is None else out + w.bias.to(out.dtype)
    if w.tiled is not None:
        return bf16_matmul.matmul(x, w.tiled, w.out_features, w.tiled_bias)
    if w.packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, w.packed, w.bias, "none", [], "")
    if w.widened is None:
        return F.linear(x, w.weight, w.bias)
    if x.shape[0] <= BF16_GEMV_MAX_ROWS:
        return F.linear(x.to(w.weight.dtype), w.weight, w.bias).to(x.dtype)
    wide = x.float()  # models keep float32 activations here (Weights.activation_dtype): no copy
    if w.half is not None and x.shape[0] <= HALF_WEIGHT_MAX_ROWS:
        out = torch.fbgemm_linear_fp16_weight(wide.contiguous(), w.half, w.wide_bias)
    else:
        out = F.linear(wide, w.widened, w.wide_bias)
    return out.to(x.dtype)


class _LoraHost(nn.Module):
    """A linear layer LoRA adapters may change: where from (`lora_source`), and their update."""

    def __init__(self, lora_source: LoraSource | None):
        super().__init__()
        # where adapters may change this layer (checkpoint modules; None: nowhere), and the
        # adapters' update once one does
        self.lora_source = lora_source
        self.lora: LoraTarget | None = None

    def attach_lora(self, target: LoraTarget) -> None:
        """Adds the adapters' update `target` to every forward from now on."""
        self.lora = target

    def detach_lora(self) -> None:
        """Forwards cost nothing for adapters again: the last one was unloaded."""
        self.lora = None


class ColumnParallelLinear(_LoraHost):
    """y = x W^T + b with the rows of W (output features) split across ranks.

    Several checkpoint tensors may be fused into one matmul (q/k/v, gate/up): each is split on its own
    and the slices are concatenated, so rank r holds [q_r; k_r; v_r].
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 quantize_kind: str | None = None, model_dtype: torch.dtype | None = None,
                 lora_source: LoraSource | None = None):
        super().__init__(lora_source)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.prepared = LinearWeight.prepare(weight, self.bias, quantize_kind, model_dtype)

    @classmethod
    def load(cls, weights: Weights, prefixes: list[str], *, bias: bool) -> "ColumnParallelLinear":
        weight = join_rows([weights.get_sharded(f"{p}.weight", dim=0,
                                                as_stored=weights.quantizing) for p in prefixes])
        bias_t = None
        if bias:
            bias_t = torch.cat([weights.get_sharded(f"{p}.bias", dim=0) for p in prefixes], dim=0)
        lora_source = _lora_source(
            weights, [CheckpointPart(p, [weights.shape(f"{p}.weight")[0]]) for p in prefixes],
            weight.shape[1], row_parallel=False)
        return cls(weight, bias_t, weights.quantize, weights.dtype, lora_source)

    @classmethod
    def load_fused(cls, weights: Weights, prefix: str, sizes: list[int], *, bias: bool,
                   row_order: torch.Tensor | None = None) -> "ColumnParallelLinear":
        """A layer from one checkpoint tensor that stacks several projections of `sizes` rows.

        Such as Phi-3's qkv_proj and gate_up_proj: each part is split across ranks on its own, so
        rank r holds [q_r; k_r; v_r] as `load` gives it from separate tensors. `row_order`: the rows
        of this rank's weight in the order the layer holds them (a model that lays out its heads'
        dimensions its own way)."""
        weight = fused_rows(weights, f"{prefix}.weight", sizes, as_stored=weights.quantizing)
        bias_t = fused_rows(weights, f"{prefix}.bias", sizes) if bias else None
        if row_order is not None:
            if isinstance(weight, BlockStack):
                weight = weight.take(row_order.to(weight.parts[0].data.device))
            else:
                weight = weight[row_order.to(weight.device)].contiguous()
            bias_t = None if bias_t is None else bias_t[row_order].contiguous()
        lora_source = _lora_source(weights, [CheckpointPart(prefix, list(sizes))],
                                   weight.shape[1], row_parallel=False, row_order=row_order)
        return cls(weight, bias_t, weights.quantize, weights.dtype, lora_source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.prepared)
        return out if self.lora is None else self.lora.add_to(x, out)


def fused_rows(weights: Weights, name: str, sizes: list[int], *,
               as_stored: bool = False) -> torch.Tensor:
    """This rank's rows of a fused tensor: its 1/world_size of each part, concatenated in order.

    `name`'s rows stack parts of `sizes` rows; only this rank's rows are read."""
    rows = weights.shape(name)[0]
    if sum(sizes) != rows:
        raise ValueError(f"{name}: {rows} rows, not the {' + '.join(map(str, sizes))} of the "
                         "projections the config describes")
    ctx = weights.parallel
    parts, start = [], 0
    for size in sizes:
        if size % ctx.world_size:
            raise ValueError(f"{name}: a part of {size} rows does not divide by "
                             f"{ctx.world_size} shards")
        block = size // ctx.world_size
        first = start + ctx.rank * block
        parts.append(weights.get_rows(name, first, first + block, as_stored=as_stored))
        start += size
    return join_rows(parts)


class RowParallelLinear(_LoraHost):
    """y = sum over ranks of x_r W_r^T, then + b once: W's columns (input features) are split."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, parallel: ParallelContext,
                 quantize_kind: str | None = None, model_dtype: torch.dtype | None = None,
                 lora_source: LoraSource | None = None):
        super().__init__(lora_source)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.parallel = parallel
        self.prepared = LinearWeight.prepare(weight, quantize_kind=quantize_kind,
                                             model_dtype=model_dtype)

    @classmethod
    def load(cls, weights: Weights, prefix: str, *, bias: bool) -> "RowParallelLinear":
        weight = weights.get_sharded(f"{prefix}.weight", dim=1, as_stored=weights.quantizing)
        bias_t = weights.get(f"{prefix}.bias") if bias else None
        out_rows, full_in = weights.shape(f"{prefix}.weight")
        lora_source = _lora_source(weights, [CheckpointPart(prefix, [out_rows])], full_in,
                                   row_parallel=True)
        return cls(weight, bias_t, weights.parallel, weights.quantize, weights.dtype, lora_source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.prepared)
        if self.lora is not None:  # this rank's share of the update joins its partial sum
            out = self.lora.add_to(x, out)
        out = all_reduce(out, self.parallel)
        if self.bias is not None:
            out = out + self.bias
        return out


def _lora_source(weights: Weights, parts: list[CheckpointPart], in_features: int, *,
                 row_parallel: bool, row_order: torch.Tensor | None = None) -> LoraSource:
    return LoraSource(parts, in_features, row_parallel, weights.parallel, weights.dtype,
                      weights.device, row_order)
