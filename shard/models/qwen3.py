"""Qwen3.

The Llama decoder layer with an RMS norm over each query and key head before the rotation, and
sliding-window attention on the layers its config names (none unless use_sliding_window).

The Mixture-of-Experts variant (shard.models.qwen3_moe) builds on these classes, swapping the MLP.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from shard.layers.attention import paged_attention, rotate_and_store
from shard.layers.attention_state import AttentionMetadata, LayerCache
from shard.layers.embedding import VocabParallelEmbedding
from shard.layers.norm import RMSNorm
from shard.layers.rotary import RotaryAngles, RotaryEmbedding
from shard.models.decoder import DecoderLM, load_lm_head
from shard.models.decode_layout import DecodeLayout
from shard.models.llama import (LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaMLP,
                                llama_decode_layout)
from shard.partition import RankHeads
from shard.weights import Weights

# transformers' Qwen3Config default: with use_sliding_window, layers from this index on slide
DEFAULT_MAX_WINDOW_LAYERS = 28
_WINDOW_KEYS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")


@dataclass(slots=True, kw_only=True)
class Qwen3Config(LlamaConfig):
    # per layer: the sliding window it attends over, or None for full attention
    layer_windows: tuple[int | None, ...]

    @classmethod
    def from_dict(cls, cfg: dict, **defaults) -> "Qwen3Config":
        return cls(**llama_fields(cfg, **defaults), layer_windows=qwen3_layer_windows(cfg))


def llama_fields(cfg: dict, **defaults) -> dict:
    """The fields a config.json gives LlamaConfig, for a config class that extends it.

    The sliding window is left out (LlamaConfig's is one window on every layer, Mistral's): Qwen3's
    are per layer, in layer_windows."""
    windowless = {key: value for key, value in cfg.items() if key not in _WINDOW_KEYS}
    base = LlamaConfig.from_dict(windowless, **defaults)
    return {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaConfig)}


def sliding_window(cfg: dict) -> int | None:
    """The window of the sliding layers.

    None unless use_sliding_window (Qwen3's configs name a sliding_window they do not use)."""
    return cfg.get("sliding_window") if cfg.get("use_sliding_window") else None


def qwen3_layer_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each layer's window as transformers' Qwen3 sets it.

    The layers `layer_types` marks "sliding_attention", or without layer_types those from
    max_window_layers on, slide over sliding_window when use_sliding_window is set; every other
    layer attends to everything."""
    window = sliding_window(cfg)
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                 for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {layers}")
    return tuple(window if kind == "sliding_attention" else None for kind in types)


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: LlamaConfig, heads: RankHeads, weights: Weights, prefix: str,
                 window: int | None):
        super().__init__(cfg, heads, weights, prefix)
        # over head_dim, so they apply per head whatever the rank's share of heads
        self.q_norm = RMSNorm(weights.get(f"{prefix}.q_norm.weight"), cfg.rms_norm_eps,
                              weights.activation_dtype)
        self.k_norm = RMSNorm(weights.get(f"{prefix}.k_norm.weight"), cfg.rms_norm_eps,
                              weights.activation_dtype)
        self.window = window

    def forward(self, hidden: torch.Tensor, angles: RotaryAngles, cache: LayerCache,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        tokens, d = qkv.shape[0], self.head_dim
        q_size, k_size = self.num_heads * d, self.num_kv_heads * d
        # each head's vector normed on its own, then the fused layout rotate_and_store takes
        queries = self.q_norm(qkv[:, :q_size].reshape(-1, d)).view(tokens, q_size)
        keys = self.k_norm(qkv[:, q_size:q_size + k_size].reshape(-1, d)).view(tokens, k_size)
        qkv = torch.cat([queries, keys, qkv[:, q_size + k_size:]], dim=1)
        q, k, v = rotate_and_store(qkv, angles, self.num_heads, self.num_kv_heads, d, cache, meta)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale, window=self.window))


class Qwen3ForCausalLM(DecoderLM):
    """The interface of LlamaForCausalLM; `build_mlp` makes each layer's feed-forward block."""

    def __init__(self, cfg: Qwen3Config, heads: RankHeads, weights: Weights):
        super().__init__()
        self.config = cfg
        self.activation_dtype = weights.activation_dtype
        self.embed_tokens = VocabParallelEmbedding.load(weights, "model.embed_tokens.weight")
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling, weights.activation_dtype, weights.device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, heads, weights, f"model.layers.{i}",
                              attention=Qwen3Attention(cfg, heads, weights,
                                                       f"model.layers.{i}.self_attn",
                                                       cfg.layer_windows[i]),
                              mlp=self.build_mlp(cfg, weights, f"model.layers.{i}.mlp", i))
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(weights.get("model.norm.weight"), cfg.rms_norm_eps,
                            weights.activation_dtype)
        self.lm_head = load_lm_head(weights, self.embed_tokens, tied=cfg.tie_word_embeddings,
                                    vocab_size=cfg.vocab_size)

    def build_mlp(self, cfg: Qwen3Config, weights: Weights, prefix: str, layer: int) -> nn.Module:
        return LlamaMLP(cfg, weights, prefix)

    def decode_layout(self) -> DecodeLayout:
        """Llama's layer with each query and key head normed."""
        return llama_decode_layout(self, qk_norm=True)
