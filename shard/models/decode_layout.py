"""What a model family declares about its decode step, the only view of a model the C step reads.

The C decode step (shard.decode_paths.c_step) computes Llama's layer: an RMS norm, attention over
a fused q/k/v projection with one rotary table, an RMS norm, a silu-gated MLP over a fused gate/up
projection. A family's `decode_layout()` hands over its modules in that shape and names what it
computes beyond it (another norm, activation or rotary table, per-head norms, soft-capping); the
C step steps aside for anything named there.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

RMS_NORM = "rms"  # Llama's: normed rows rounded to the activations' dtype, then scaled
GEMMA_NORM = "gemma"  # scaled by 1 + weight in float32, around attention and the MLP too
SILU = "silu"  # silu(gate) * up
GELU_TANH = "gelu_tanh"  # gelu(gate, tanh approximation) * up
EXPERTS = "experts"  # a Mixture-of-Experts block on some layers


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's modules in the order the C step runs them."""

    input_norm: nn.Module  # .weight, .eps
    post_attention_norm: nn.Module  # .weight, .eps
    qkv_proj: nn.Module  # column-parallel linear layers: .prepared, .bias, .lora_source, .lora
    o_proj: nn.Module  # row-parallel
    gate_up_proj: nn.Module
    down_proj: nn.Module  # row-parallel
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # of the attention scores
    window: int | None  # the keys a query sees, itself included; None: the whole context

    @property
    def projections(self) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj


@dataclass(frozen=True, slots=True)
class DecodeLayout:
    """A model's decode step as its family declares it; empty `layers` where it is not Llama's."""

    family: str  # named in the log's reasons
    activation_dtype: torch.dtype
    hidden_size: int
    embed: Callable[[torch.Tensor], torch.Tensor]  # input_ids [B] -> [B, hidden]
    rotary: Callable | None  # positions [B] -> RotaryAngles; None: a table per kind of layer
    layers: tuple[LayerWeights, ...]
    final_norm: nn.Module  # .weight, .eps
    lm_head: nn.Module  # ParallelLMHead: .prepared, .parallel, .vocab_size
    norm: str = RMS_NORM
    mlp: str = SILU
    qk_norm: bool = False  # each query and key head normed before the rotation
    attention_softcap: float | None = None  # scores become c * tanh(scores / c)
    logit_softcap: float | None = None

    def departures(self) -> list[str]:
        """What this model computes beyond Llama's layer, in words; empty where nothing."""
        found = []
        if self.norm != RMS_NORM:
            found.append(f"{self.norm} norms, not Llama's RMS norms")
        if self.mlp != SILU:
            found.append(f"a {self.mlp} MLP, not a silu-gated one")
        if self.qk_norm:
            found.append("a norm over each query and key head")
        if self.attention_softcap is not None or self.logit_softcap is not None:
            found.append("soft-capped scores")
        if self.rotary is None:
            found.append("a rotary table per kind of layer")
        if not self.layers:
            found.append("layers not laid out as Llama's")
        return found
