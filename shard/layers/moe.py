"""A sparse Mixture-of-Experts feed-forward block (Qwen3-MoE), expert-parallel across ranks.

A router picks top_k experts per token and the token's output is their SwiGLU outputs weighted
by the router's probabilities.

Expert parallel across tensor-parallel ranks: rank r holds whole experts, a contiguous 1/world_size
of them, and the router replicated; every rank routes every token (they all hold the full hidden
states), computes its own experts' contributions, and the ranks sum them with one all-reduce, as a
row-parallel projection sums its partial products.

Each expert's projections are held as the dense layers' are (shard/layers/linear.py): a native
GGUF's blocks or a quantized checkpoint's groups in our int4/int8 kernels' forms where they run,
else as stored and dequantized a layer at a time; --quantize's forms otherwise.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from shard.distributed import ParallelContext, all_reduce
from shard.kernels import layer_ops
from shard.layers.ggml_quants import BlockStack, join_rows
from shard.layers.linear import LinearWeight, linear
from shard.weights import Weights


def local_experts(num_experts: int, parallel: ParallelContext) -> range:
    """The experts rank `parallel.rank` holds; ValueError where they do not split evenly."""
    if num_experts % parallel.world_size:
        raise ValueError(f"{parallel.world_size} shards do not divide the model's {num_experts} "
                         f"experts (each shard holds whole experts); use a shard count that "
                         f"divides {num_experts}")
    share = num_experts // parallel.world_size
    return range(parallel.rank * share, (parallel.rank + 1) * share)


class LocalLinear(nn.Module):
    """x W^T by a weight this rank holds whole: no slice of it elsewhere, nothing to sum."""

    def __init__(self, weight: "torch.Tensor | BlockStack", quantize_kind: str | None = None,
                 model_dtype: torch.dtype | None = None):
        super().__init__()
        self.prepared = LinearWeight.prepare(weight, None, quantize_kind, model_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.prepared)


class Expert(nn.Module):
    """One expert's SwiGLU MLP, its gate and up projections fused into one matmul."""

    def __init__(self, gate_up: LocalLinear, down: LocalLinear):
        super().__init__()
        self.gate_up_proj = gate_up
        self.down_proj = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """A MoE block: each token's top_k experts' outputs, summed weighted by the router.

    As transformers' Qwen3MoeSparseMoeBlock, over this rank's experts, then across the ranks."""

    def __init__(self, router: LocalLinear, experts: list[Expert], *, first_expert: int,
                 num_experts: int, top_k: int, norm_topk_prob: bool, parallel: ParallelContext):
        super().__init__()
        self.gate = router
        self.experts = nn.ModuleList(experts)  # this rank's, in order from first_expert
        self.first_expert = first_expert
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.parallel = parallel

    @classmethod
    def load(cls, weights: Weights, prefix: str, *, num_experts: int, top_k: int,
             intermediate_size: int, norm_topk_prob: bool) -> "SparseMoeBlock":
        """The block from `prefix`, with only this rank's experts read.

        `prefix`.gate.weight [E, hidden] is the router. The experts come per expert, as the Hub
        stores them (`prefix`.experts.{e}.gate_proj/up_proj/down_proj.weight), or fused as
        transformers 5 holds them in memory and saves them with save_original_format=False
        (`prefix`.experts.gate_up_proj [E, 2 * inter, hidden], gate rows first, and
        `prefix`.experts.down_proj [E, hidden, inter]); this rank reads only its own."""
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{prefix}: {top_k} experts per token out of {num_experts}")
        mine = local_experts(num_experts, weights.parallel)
        router_shape = weights.shape(f"{prefix}.gate.weight")
        if router_shape[0] != num_experts:
            raise ValueError(f"{prefix}.gate.weight routes to {router_shape[0]} experts, the "
                             f"config names {num_experts}")
        hidden = router_shape[1]
        # the router stays in the model dtype, never quantized: a rounded score moves a token to
        # another expert, not by a rounding
        router = LocalLinear(weights.get(f"{prefix}.gate.weight"))
        experts = [Expert(LocalLinear(gate_up, weights.quantize, weights.dtype),
                          LocalLinear(down, weights.quantize, weights.dtype))
                   for gate_up, down in _expert_weights(weights, f"{prefix}.experts", num_experts,
                                                        mine, intermediate_size, hidden)]
        return cls(router, experts, first_expert=mine.start, num_experts=num_experts, top_k=top_k,
                   norm_topk_prob=norm_topk_prob, parallel=weights.parallel)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice: x [T, hidden] -> (weights [T, top_k], experts [T, top_k]).

        The weights are in x's dtype, as transformers' Qwen3MoeTopKRouter computes them: softmax in
        float32 over every expert, the top_k, renormalised to sum to one with norm_topk_prob."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return top_weights.to(logits.dtype), top_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the experts' weighted sum [T, hidden], summed across ranks."""
        weights, experts = self.route(x)
        # a CUDA graph cannot hold the host read of how many tokens each expert got, nor can a
        # whole-graph trace (--compile-decode): there every expert of this rank runs over every
        # row instead, which reads all of their weights where the grouped form reads the chosen
        static = torch.compiler.is_compiling() or (x.is_cuda
                                                   and torch.cuda.is_current_stream_capturing())
        out = (self._every_expert(x, weights, experts) if static
               else self._grouped(x, weights, experts))
        return all_reduce(out, self.parallel)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor,
                 experts: torch.Tensor) -> torch.Tensor:
        """Each of this rank's experts once, over the rows routed to it, gathered together."""
        tokens, top_k = experts.shape
        flat = experts.reshape(-1)  # token t's choices at t * top_k ...
        order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending in each
        chosen_weights = weights.reshape(-1, 1).index_select(0, order)
        rows_of = order // top_k
        # one read back to the host: where each expert's group starts
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        starts = [0, *itertools.accumulate(counts)]
        # each choice's weighted output, in the grouped order; other ranks' experts' stay zero
        grouped = x.new_zeros(tokens * top_k, x.shape[1])
        for index, expert in enumerate(self.experts, start=self.first_expert):
            start, stop = starts[index], starts[index + 1]
            if start < stop:
                rows = x.index_select(0, rows_of[start:stop])
                grouped[start:stop] = expert(rows) * chosen_weights[start:stop]
        # back in token order, then each token's top_k summed: a gather, where index_add_ into
        # the output would scatter (and CPU PyTorch parallelises that poorly at decode sizes)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.shape[0], device=order.device)
        return grouped.index_select(0, back).view(tokens, top_k, -1).sum(dim=1)

    def _every_expert(self, x: torch.Tensor, weights: torch.Tensor,
                      experts: torch.Tensor) -> torch.Tensor:
        """The weighted sum of this rank's experts over every row, with shapes fixed by x alone.

        Each expert runs over every row, weighted by the router's weight for it (zero where the row
        did not choose it): the same sum as routing only the chosen rows."""
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts, start=self.first_expert):
            chosen = experts == index  # [T, top_k], one True at most a row
            weight = (weights * chosen).sum(dim=-1, keepdim=True)
            out = out + expert(x) * weight
        return out


def _expert_weights(weights: Weights, prefix: str, num_experts: int, experts: range, inter: int,
                    hidden: int):
    """The (gate_up [2 * inter, hidden], down [hidden, inter]) weights of each expert in `experts`.

    In the model dtype, or as stored when the layers quantize them (see Weights.quantizing): a
    native GGUF's blocks (one matrix per expert, launcher/gguf.py) or a quantized checkpoint's
    groups come as BlockStacks, which LinearWeight holds in the dense layers' quantized forms."""
    as_stored = weights.quantizing
    fused = f"{prefix}.gate_up_proj"
    if weights.has(fused):
        # [E, 2 * inter, hidden] and [E, hidden, inter]: other families transpose theirs
        _check_shape(weights, fused, [num_experts, 2 * inter, hidden])
        _check_shape(weights, f"{prefix}.down_proj", [num_experts, hidden, inter])
        gate_up = weights.get_rows(fused, experts.start, experts.stop, as_stored=as_stored)
        down = weights.get_rows(f"{prefix}.down_proj", experts.start, experts.stop,
                                as_stored=as_stored)
        for index in range(len(experts)):
            yield gate_up[index].contiguous(), down[index].contiguous()
        return

    def read(name: str, shape: list[int]) -> torch.Tensor:
        _check_shape(weights, name, shape)
        return weights.get_rows(name, 0, shape[0], as_stored=as_stored)

    for expert in experts:
        base = f"{prefix}.{expert}"
        # quantized rows (a GGUF's blocks, a checkpoint's groups) join as one stack, as a dense
        # MLP's gate and up do
        yield (join_rows([read(f"{base}.gate_proj.weight", [inter, hidden]),
                          read(f"{base}.up_proj.weight", [inter, hidden])]),
               read(f"{base}.down_proj.weight", [hidden, inter]))


def _check_shape(weights: Weights, name: str, expected: list[int]) -> None:
    shape = weights.shape(name)
    if shape != expected:
        raise ValueError(f"{name} is {shape}, not {expected} (from the config's num_experts, "
                         f"moe_intermediate_size and hidden_size)")
