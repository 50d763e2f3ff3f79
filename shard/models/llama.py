"""The Llama family (Llama, Mistral, Qwen2, SmolLM2): decoder layers over paged attention.

Variants differ only in configuration: grouped-query attention, rope theta and scaling, biases on the
attention projections, tied embeddings.
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
from shard.layers.rotary import RotaryAngles, RotaryEmbedding
from shard.models.decode_layout import DecodeLayout, LayerWeights
from shard.models.decoder import DecoderLM, load_lm_head
from shard.partition import RankHeads
from shard.weights import Weights


@dataclass(slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Mistral's: each query sees the last sliding_window positions, itself included; None: all
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, cfg: dict, *, qkv_bias_default: bool = False) -> "LlamaConfig":
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        attention_bias = cfg.get("attention_bias")
        if attention_bias is None:
            attention_bias = qkv_bias_default
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                              else None)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=attention_bias,
            o_bias=bool(cfg.get("attention_bias")),
            mlp_bias=cfg.get("mlp_bias", False),
            sliding_window=_sliding_window(cfg),
        )


def _sliding_window(cfg: dict) -> int | None:
    """Mistral's sliding_window (absent or null: none).

    Qwen2 configs carry one with use_sliding_window false, which turns it off; on, it would slide
    only from layer max_window_layers on, which these layers do not do: refused rather than served
    wrongly."""
    window = cfg.get("sliding_window")
    # transformers' Qwen2Config defaults use_sliding_window to false; Mistral's has no such switch
    if not window or not cfg.get("use_sliding_window", cfg.get("model_type") != "qwen2"):
        return None
    if cfg.get("max_window_layers", 0) > 0:  # Qwen2's
        if cfg["max_window_layers"] >= cfg["num_hidden_layers"]:
            return None  # no layer slides
        raise ValueError(f"a sliding window on layers {cfg['max_window_layers']} and up only "
                         "(use_sliding_window with max_window_layers) is not supported")
    # a window as long as the model's context leaves every key in view: no window, which keeps
    # the plain attention paths (and the C decode step)
    return window if window < cfg.get("max_position_embeddings", 4096) else None


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, heads: RankHeads, weights: Weights, prefix: str):
        super().__init__()
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.window = cfg.sliding_window
        self.qkv_proj = ColumnParallelLinear.load(
            weights, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"], bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear.load(weights, f"{prefix}.o_proj", bias=cfg.o_bias)

    def forward(self, hidden: torch.Tensor, angles: RotaryAngles, cache: LayerCache,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = rotate_and_store(self.qkv_proj(hidden), angles, self.num_heads,
                                   self.num_kv_heads, self.head_dim, cache, meta)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale, window=self.window))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, weights: Weights, prefix: str):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.load(
            weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear.load(weights, f"{prefix}.down_proj", bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then MLP.

    Families with Llama's norms and residual stream (Qwen3, Phi-3) give their own `attention` and
    `mlp` blocks (else Llama's)."""

    def __init__(self, cfg: LlamaConfig, heads: RankHeads, weights: Weights, prefix: str, *,
                 attention: nn.Module | None = None, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(weights.get(f"{prefix}.input_layernorm.weight"),
                                       cfg.rms_norm_eps, weights.activation_dtype)
        self.self_attn = (attention if attention is not None
                          else LlamaAttention(cfg, heads, weights, f"{prefix}.self_attn"))
        self.post_attention_layernorm = RMSNorm(
            weights.get(f"{prefix}.post_attention_layernorm.weight"), cfg.rms_norm_eps,
            weights.activation_dtype)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, weights, f"{prefix}.mlp")

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, angles: RotaryAngles,
                cache: LayerCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's output and the residual stream it is to be added to.

        hidden: the previous layer's output, not yet added to the residual stream (the embeddings
        at the first layer, with no residual). Each add is fused with the norm that reads its
        result."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm.add_norm(hidden, residual)
        attention = self.self_attn(normed, angles, cache, meta)
        normed, residual = self.post_attention_layernorm.add_norm(attention, residual)
        return self.mlp(normed), residual

    def decode_weights(self) -> LayerWeights:
        """This layer's modules as the C decode step reads them (its MLP a gated one)."""
        attention, mlp = self.self_attn, self.mlp
        return LayerWeights(self.input_layernorm, self.post_attention_layernorm,
                            attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj,
                            attention.num_heads, attention.num_kv_heads, attention.head_dim,
                            attention.scale, attention.window)


def llama_decode_layout(model: DecoderLM, *, dense: bool = True, **departures) -> DecodeLayout:
    """The DecodeLayout of a model built of LlamaDecoderLayers.

    `departures` name what its layers compute beyond Llama's (DecodeLayout's fields), `dense` False
    where some MLPs are experts."""
    return DecodeLayout(
        family=type(model).__name__, activation_dtype=model.activation_dtype,
        hidden_size=model.config.hidden_size, embed=model.embed, rotary=model.rotary,
        layers=tuple(layer.decode_weights() for layer in model.layers) if dense else (),
        final_norm=model.norm, lm_head=model.lm_head, **departures)


class LlamaForCausalLM(DecoderLM):
    """`heads` are this rank's share (shard.partition); `weights` hands out this rank's slices."""

    def __init__(self, cfg: LlamaConfig, heads: RankHeads, weights: Weights):
        super().__init__()
        self.config = cfg
        self.activation_dtype = weights.activation_dtype
        self.embed_tokens = VocabParallelEmbedding.load(weights, "model.embed_tokens.weight")
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, weights.activation_dtype, weights.device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, heads, weights, f"model.layers.{i}")
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(weights.get("model.norm.weight"), cfg.rms_norm_eps,
                            weights.activation_dtype)
        self.lm_head = load_lm_head(weights, self.embed_tokens, tied=cfg.tie_word_embeddings,
                                    vocab_size=cfg.vocab_size)

    def decode_layout(self) -> DecodeLayout:
        """Llama's layer, the one the C decode step computes."""
        return llama_decode_layout(self)
