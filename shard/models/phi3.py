"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini).

Llama's decoder layer with q/k/v and gate/up each stored as one fused tensor, LongRoPE frequency
scaling, an optional sliding window and, in Phi-4-mini, rotation of only part of each head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shard.kernels import layer_ops
from shard.layers.attention import paged_attention, rotate_and_store
from shard.layers.attention_state import AttentionMetadata, LayerCache
from shard.layers.embedding import VocabParallelEmbedding
from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from shard.layers.norm import RMSNorm
from shard.layers.rotary import RotaryAngles, RotaryEmbedding, partial_rotary_order, rope_type
from shard.models.decoder import DecoderLM, load_lm_head
from shard.models.decode_layout import DecodeLayout
from shard.models.llama import LlamaDecoderLayer, llama_decode_layout
from shard.partition import RankHeads
from shard.weights import Weights


@dataclass(slots=True)
class Phi3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int  # the leading dimensions of each head that rotate (partial_rotary_factor)
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # LongRoPE's, with its original_max_position_embeddings
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None  # None: every layer attends to the whole context

    @classmethod
    def from_dict(cls, cfg: dict) -> "Phi3Config":
        """config.json as transformers' Phi3Config reads it.

        Its older form (rope_scaling, with type "su" or "longrope", rope_theta and
        partial_rotary_factor beside it) or the newer (rope_parameters holding them all)."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Phi-3 with hidden_act {cfg['hidden_act']!r} is not supported "
                             "(supported: silu)")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope = cfg.get("rope_parameters") or {}
        scaling = dict(cfg.get("rope_scaling") or rope)
        max_positions = cfg.get("max_position_embeddings", 4096)
        if rope_type(scaling) == "default":
            scaling = None
        elif rope_type(scaling) == "yarn":  # transformers reads a Phi-3 config's "yarn" as LongRoPE
            scaling["rope_type"] = "longrope"
        if scaling is not None:
            # transformers prefers the top-level value Phi-3 configs carry, and defaults it to 4096
            scaling["original_max_position_embeddings"] = (
                cfg.get("original_max_position_embeddings")
                or scaling.get("original_max_position_embeddings") or 4096)
        partial = float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor")
                        or 1.0)
        window = cfg.get("sliding_window")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # a window as long as the model's context leaves every key in view (Phi-3-mini-128k's
            # 262144): no window, which keeps the plain attention paths
            sliding_window=window if window and window < max_positions else None,
        )


class Phi3Attention(nn.Module):
    def __init__(self, cfg: Phi3Config, heads: RankHeads, weights: Weights, prefix: str):
        super().__init__()
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.sliding_window
        d = cfg.head_dim
        # this rank's share of each of q, k and v, though the checkpoint stacks them in one tensor
        self.qkv_proj = ColumnParallelLinear.load_fused(
            weights, f"{prefix}.qkv_proj",
            [cfg.num_attention_heads * d, cfg.num_key_value_heads * d,
             cfg.num_key_value_heads * d], bias=False,
            row_order=_query_key_order(cfg, heads) if cfg.rotary_dim < d else None)
        self.o_proj = RowParallelLinear.load(weights, f"{prefix}.o_proj", bias=False)

    def forward(self, hidden: torch.Tensor, angles: RotaryAngles, cache: LayerCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = rotate_and_store(self.qkv_proj(hidden), angles, self.num_heads,
                                   self.num_kv_heads, self.head_dim, cache, meta)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale, window=self.window))


def _query_key_order(cfg: Phi3Config, heads: RankHeads) -> torch.Tensor:
    """The rows of a rank's fused [q; k; v] weight, its heads' dimensions in rotation order.

    Each query and key head's dimensions in partial_rotary_order (values keep theirs: they do not
    rotate)."""
    d = cfg.head_dim
    within = partial_rotary_order(d, cfg.rotary_dim)
    rotated = heads.num_heads + heads.num_kv_heads
    order = (torch.arange(rotated).unsqueeze(1) * d + within).reshape(-1)
    return torch.cat([order, torch.arange(rotated * d, (rotated + heads.num_kv_heads) * d)])


class Phi3MLP(nn.Module):
    def __init__(self, cfg: Phi3Config, weights: Weights, prefix: str):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.load_fused(
            weights, f"{prefix}.gate_up_proj", [cfg.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear.load(weights, f"{prefix}.down_proj", bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x)))


class Phi3ForCausalLM(DecoderLM):
    """`heads` are this rank's share (shard.partition); `weights` hands out this rank's slices."""

    def __init__(self, cfg: Phi3Config, heads: RankHeads, weights: Weights):
        super().__init__()
        self.config = cfg
        self.activation_dtype = weights.activation_dtype
        self.embed_tokens = VocabParallelEmbedding.load(weights, "model.embed_tokens.weight")
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, weights.activation_dtype, weights.device,
                                      rotary_dim=cfg.rotary_dim)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, heads, weights, f"model.layers.{i}",
                              attention=Phi3Attention(cfg, heads, weights,
                                                      f"model.layers.{i}.self_attn"),
                              mlp=Phi3MLP(cfg, weights, f"model.layers.{i}.mlp"))
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(weights.get("model.norm.weight"), cfg.rms_norm_eps,
                            weights.activation_dtype)
        self.lm_head = load_lm_head(weights, self.embed_tokens, tied=cfg.tie_word_embeddings,
                                    vocab_size=cfg.vocab_size)

    def decode_layout(self) -> DecodeLayout:
        """Llama's layer once loaded: partial rotation and LongRoPE live in the rotary table."""
        return llama_decode_layout(self)
