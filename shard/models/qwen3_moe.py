"""Qwen3-MoE.

Qwen3's attention with a sparse Mixture-of-Experts block (shard.layers.moe) in place of the MLP on
its sparse layers, and no shared expert.

Which layers are sparse, as transformers decides: not those in mlp_only_layers, and among the rest
every decoder_sparse_step-th (all of them at the default step of 1). The others keep a dense MLP of
intermediate_size. Where the config turns sliding windows on, every layer slides (transformers'
Qwen3-MoE reads no max_window_layers nor layer_types).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shard.layers.moe import SparseMoeBlock
from shard.models.decode_layout import EXPERTS, DecodeLayout
from shard.models.llama import LlamaMLP, llama_decode_layout
from shard.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, llama_fields, sliding_window
from shard.weights import Weights


@dataclass(slots=True, kw_only=True)
class Qwen3MoeConfig(Qwen3Config):
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: a Mixture-of-Experts block, else a dense MLP

    @classmethod
    def from_dict(cls, cfg: dict, **defaults) -> "Qwen3MoeConfig":
        layers = cfg["num_hidden_layers"]
        # the Hub's configs say num_experts; transformers 5 saves it as num_local_experts
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 128))
        step = cfg.get("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        return cls(
            **llama_fields(cfg, **defaults),
            layer_windows=(sliding_window(cfg),) * layers,
            num_experts=experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 8),
            moe_intermediate_size=cfg.get("moe_intermediate_size", 768),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            sparse_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                                for i in range(layers)),
        )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def build_mlp(self, cfg: Qwen3MoeConfig, weights: Weights, prefix: str,
                  layer: int) -> nn.Module:
        if not cfg.sparse_layers[layer]:
            return LlamaMLP(cfg, weights, prefix)
        return SparseMoeBlock.load(weights, prefix, num_experts=cfg.num_experts,
                                   top_k=cfg.num_experts_per_tok,
                                   intermediate_size=cfg.moe_intermediate_size,
                                   norm_topk_prob=cfg.norm_topk_prob)

    def decode_layout(self) -> DecodeLayout:
        """Qwen3's layer with experts in place of some MLPs."""
        return llama_decode_layout(self, dense=False, qk_norm=True, mlp=EXPERTS)
