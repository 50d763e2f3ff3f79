"""Gemma 2 and Gemma 3 (text).

Decoder layers over paged attention, as transformers' modeling_gemma2.py and modeling_gemma3.py
compute them.

What sets them apart from Llama: layers alternate between sliding-window attention and global
attention (Gemma 3 with its own rope base per kind); each layer normalises four times, before and
after attention and before and after the MLP, with norms that scale by 1 + weight; the MLP is
gelu(tanh)-gated; embeddings are scaled by sqrt(hidden_size); attention scales by
query_pre_attn_scalar**-0.5; Gemma 2 soft-caps attention scores and final logits (c * tanh(x / c)),
Gemma 3 normalises each query and key head instead (and soft-caps the logits only where its config
asks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shard.kernels import layer_ops
from shard.layers.attention import paged_attention, rotate_and_store
from shard.layers.attention_state import AttentionMetadata, LayerCache
from shard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from shard.layers.rotary import RotaryAngles, RotaryEmbedding
from shard.models.decode_layout import GELU_TANH, GEMMA_NORM, DecodeLayout
from shard.partition import RankHeads
from shard.weights import Weights

SLIDING, FULL = "sliding_attention", "full_attention"

# transformers' Gemma2Config / Gemma3TextConfig defaults: a checkpoint's config.json may leave any
# of these out (Gemma 3's multimodal configs name only a handful in their text_config)
_DEFAULTS = {
    2: dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
            max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
            query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh"),
    3: dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
            max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False,
            query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
            attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh"),
}
# Gemma 2 alternates sliding and global layers; Gemma 3 has five sliding layers to a global one
# (configs that predate layer_types name the period `sliding_window_pattern`)
_SLIDING_PERIOD = {2: 2, 3: 6}
# rope bases where a config names none: one for all of Gemma 2's layers, one per kind for Gemma 3
_GEMMA2_THETA = 10_000.0
_GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


@dataclass(slots=True)
class GemmaConfig:
    generation: int  # 2 or 3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    query_pre_attn_scalar: float
    sliding_window: int | None  # keys a sliding layer's query sees, itself included
    layer_types: list[str]  # SLIDING or FULL, one per layer
    rope: dict[str, dict]  # per layer type: rope_theta, rope_type and the scaling's parameters
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    # a Gemma3ForConditionalGeneration's config.json outside its text_config (its vision tower's
    # and image tokens'); None for a language model's
    multimodal: dict | None = None

    @classmethod
    def from_dict(cls, cfg: dict, *, generation: int) -> "GemmaConfig":
        if generation not in _DEFAULTS:
            raise ValueError(f"Gemma generation {generation} is not supported (supported: 2, 3)")
        multimodal = None
        if "text_config" in cfg:  # Gemma3ForConditionalGeneration: its language model's part
            multimodal = {k: v for k, v in cfg.items() if k != "text_config"}
            cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                                                         True)}
        value = {**_DEFAULTS[generation], **{k: v for k, v in cfg.items() if v is not None
                                             or k in ("sliding_window", "final_logit_softcapping",
                                                      "attn_logit_softcapping")}}
        if value["hidden_activation"] != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma with hidden_activation {value['hidden_activation']!r} is not "
                             "supported (supported: gelu_pytorch_tanh)")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not "
                             "a causal language model")
        if value["sliding_window"] is not None and value["sliding_window"] < 1:
            raise ValueError(f"a sliding_window of {value['sliding_window']} tokens would attend "
                             "to nothing")
        layers = value["num_hidden_layers"]
        period = cfg.get("sliding_window_pattern") or _SLIDING_PERIOD[generation]
        layer_types = cfg.get("layer_types") or [SLIDING if (i + 1) % period else FULL
                                                 for i in range(layers)]
        if len(layer_types) != layers or set(layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types {layer_types} must name {SLIDING!r} or {FULL!r} for "
                             f"each of the {layers} layers")
        heads = value["num_attention_heads"]
        return cls(
            generation=generation,
            vocab_size=value["vocab_size"],
            hidden_size=value["hidden_size"],
            intermediate_size=value["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=value["num_key_value_heads"] or heads,
            head_dim=value["head_dim"] or value["hidden_size"] // heads,
            rms_norm_eps=value["rms_norm_eps"],
            max_position_embeddings=value["max_position_embeddings"],
            tie_word_embeddings=value["tie_word_embeddings"],
            attention_bias=value["attention_bias"],
            query_pre_attn_scalar=value["query_pre_attn_scalar"],
            sliding_window=value["sliding_window"],
            layer_types=list(layer_types),
            rope=rope_by_layer_type(cfg, generation),
            attn_logit_softcapping=value["attn_logit_softcapping"],
            final_logit_softcapping=value["final_logit_softcapping"],
            multimodal=multimodal,
        )


def rope_by_layer_type(cfg: dict, generation: int) -> dict[str, dict]:
    """Each layer type's rope parameters, read as transformers reads them.

    Gemma 2 has one set for every layer (`rope_parameters`, or the older `rope_scaling` and
    `rope_theta`); Gemma 3 one per type (`rope_parameters` keyed by layer type, or the older
    `rope_theta` and `rope_scaling` for global layers and `rope_local_base_freq` for sliding
    ones)."""
    if generation == 2:
        params = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
        params.setdefault("rope_theta", cfg.get("rope_theta", _GEMMA2_THETA))
        return {SLIDING: params, FULL: params}
    nested = cfg.get("rope_parameters") or {}
    rope = {kind: dict(nested.get(kind) or {}) for kind in (SLIDING, FULL)}
    rope[FULL].update(cfg.get("rope_scaling") or {})
    rope[FULL].setdefault("rope_theta", cfg.get("rope_theta", _GEMMA3_THETA[FULL]))
    rope[SLIDING].setdefault("rope_theta", cfg.get("rope_local_base_freq", _GEMMA3_THETA[SLIDING]))
    return rope


class GemmaRMSNorm(nn.Module):
    """Gemma's RMS norm.

    The normed rows times (1 + weight), both in float32, rounded to the activations' dtype once at
    the end (Llama's rounds the normed rows before scaling): layer_ops.rms_norm's `scale_wide`,
    one Triton launch on CUDA. The 1 + is folded into the weight at load time, in float32, so no
    step converts it."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(1.0 + weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, None)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of x + residual, x + residual), as shard.layers.norm.RMSNorm.add_norm."""
        return self._norm(x, residual)

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return layer_ops.rms_norm(x, self.weight, self.eps, residual, scale_wide=True)


def _norm(weights: Weights, name: str, eps: float) -> GemmaRMSNorm:
    return GemmaRMSNorm(weights.get(name), eps)


class GemmaAttention(nn.Module):
    def __init__(self, cfg: GemmaConfig, heads: RankHeads, weights: Weights, prefix: str,
                 layer_type: str):
        super().__init__()
        self.num_heads = heads.num_heads
        self.num_kv_heads = heads.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.window = cfg.sliding_window if layer_type == SLIDING else None
        # transformers' Gemma 3 never passes attn_logit_softcapping to its attention
        self.softcap = cfg.attn_logit_softcapping if cfg.generation == 2 else None
        self.qkv_proj = ColumnParallelLinear.load(
            weights, [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
            bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear.load(weights, f"{prefix}.o_proj", bias=cfg.attention_bias)
        # per head_dim: every rank holds all of them
        self.q_norm = self.k_norm = None
        if cfg.generation == 3:
            self.q_norm = _norm(weights, f"{prefix}.q_norm.weight", cfg.rms_norm_eps)
            self.k_norm = _norm(weights, f"{prefix}.k_norm.weight", cfg.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, angles: RotaryAngles, cache: LayerCache,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        q, k, v = rotate_and_store(qkv, angles, self.num_heads, self.num_kv_heads, self.head_dim,
                                   cache, meta)
        out = paged_attention(q, k, v, cache, meta, self.scale, window=self.window,
                              softcap=self.softcap)
        return self.o_proj(out)

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv with each query and key head normed (before rotation, as Gemma 3 does).

        In the fused layout rotate_and_store reads."""
        tokens, d = qkv.shape[0], self.head_dim
        q_size, k_size = self.num_heads * d, self.num_kv_heads * d
        q = self.q_norm(qkv[:, :q_size].reshape(-1, d)).view(tokens, q_size)
        k = self.k_norm(qkv[:, q_size:q_size + k_size].reshape(-1, d)).view(tokens, k_size)
        return torch.cat([q, k, qkv[:, q_size + k_size:]], dim=1)


class GemmaMLP(nn.Module):
    def __init__(self, weights: Weights, prefix: str):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.load(
            weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias=False)
        self.down_proj = RowParallelLinear.load(weights, f"{prefix}.down_proj", bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, heads: RankHeads, weights: Weights, prefix: str,
                 layer_type: str, rope_table: str):
        super().__init__()
        self.rope_table = rope_table  # the key of its angles in GemmaForCausalLM.rotary
        eps = cfg.rms_norm_eps
        self.input_layernorm = _norm(weights, f"{prefix}.input_layernorm.weight", eps)
        self.self_attn = GemmaAttention(cfg, heads, weights, f"{prefix}.self_attn", layer_type)
        self.post_attention_layernorm = _norm(weights, f"{prefix}.post_attention_layernorm.weight",
                                              eps)
        self.pre_feedforward_layernorm = _norm(
            weights, f"{prefix}.pre_feedforward_layernorm.weight", eps)
        self.mlp = GemmaMLP(weights, f"{prefix}.mlp")
        self.post_feedforward_layernorm = _norm(
            weights, f"{prefix}.post_feedforward_layernorm.weight", eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, angles: RotaryAngles,
                cache: LayerCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's output and the residual stream it is to be added to.

        hidden: the previous layer's output, not yet added to the residual stream (the embeddings
        at the first layer, with no residual). Gemma norms a sublayer's output before adding it
        to the stream, so each add is fused with the norm that reads its sum: the next sublayer's
        input norm, as in Llama."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm.add_norm(hidden, residual)
        attention = self.post_attention_layernorm(self.self_attn(normed, angles, cache, meta))
        normed, residual = self.pre_feedforward_layernorm.add_norm(attention, residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


def _checkpoint_prefix(weights: Weights) -> str:
    """Where the language model's tensors sit.

    A causal LM's `model.`, or inside a Gemma 3 multimodal checkpoint (as transformers 5 saves it,
    or as the Hub's files were saved before)."""
    for prefix in ("model.", "model.language_model.", "language_model.model."):
        if weights.has(f"{prefix}embed_tokens.weight"):
            return prefix
    raise KeyError("no Gemma embedding (model.embed_tokens.weight) in the checkpoint")


class GemmaForCausalLM(nn.Module):
    """`heads` are this rank's share (shard.partition); `weights` hands out this rank's slices."""

    def __init__(self, cfg: GemmaConfig, heads: RankHeads, weights: Weights):
        super().__init__()
        self.config = cfg
        self.activation_dtype = weights.activation_dtype
        prefix = _checkpoint_prefix(weights)
        embedding = f"{prefix}embed_tokens.weight"
        self.embed_tokens = VocabParallelEmbedding.load(weights, embedding)
        # sqrt(hidden_size) rounded to the checkpoint's dtype, as transformers scales in the
        # embedding's dtype (a bf16 checkpoint of hidden size 3072 scales by 55.5, not 55.43)
        self.register_buffer("normalizer", torch.tensor(cfg.hidden_size ** 0.5, dtype=weights.dtype)
                             .to(device=weights.device, dtype=weights.activation_dtype),
                             persistent=False)
        # a table per distinct rope (Gemma 3: global and sliding layers; Gemma 2: one), looked up
        # once per forward for all the layers that share it
        self.rotary = nn.ModuleDict()
        table_of: dict[str, str] = {}
        for kind in dict.fromkeys(cfg.layer_types):
            table_of[kind] = next((k for k in self.rotary if cfg.rope[k] == cfg.rope[kind]), kind)
            if table_of[kind] == kind:
                self.rotary[kind] = RotaryEmbedding(
                    cfg.head_dim, cfg.max_position_embeddings, float(cfg.rope[kind]["rope_theta"]),
                    cfg.rope[kind], weights.activation_dtype, weights.device)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, heads, weights, f"{prefix}layers.{i}", kind, table_of[kind])
            for i, kind in enumerate(cfg.layer_types))
        self.norm = _norm(weights, f"{prefix}norm.weight", cfg.rms_norm_eps)
        head = next((name for name in ("lm_head.weight", "language_model.lm_head.weight")
                     if weights.has(name)), None)
        if cfg.tie_word_embeddings or head is None:
            self.lm_head = ParallelLMHead.tied(self.embed_tokens, weights, embedding,
                                               cfg.vocab_size)
        else:
            self.lm_head = ParallelLMHead.load(weights, head, cfg.vocab_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the vectors the first layer reads [T, hidden].

        Scaled by sqrt(hidden_size). Vectors a request gives in place of ids skip this, as
        transformers' inputs_embeds do."""
        return self.embed_tokens(input_ids).to(self.activation_dtype) * self.normalizer

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: AttentionMetadata, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [T, hidden], positions [T] -> the final normed hidden states.

        Those of the rows in logit_index (all T without it), which `logits` turns into scores."""
        hidden, residual = embeds.to(self.activation_dtype), None
        angles = {kind: rotary(positions) for kind, rotary in self.rotary.items()}
        for layer, cache in zip(self.layers, caches):
            hidden, residual = layer(hidden, residual, angles[layer.rope_table], cache, meta)
        if logit_index is not None:
            hidden = hidden[logit_index]
            residual = residual[logit_index] if residual is not None else None
        return self.norm(hidden) if residual is None else self.norm.add_norm(hidden, residual)[0]

    def decode_layout(self) -> DecodeLayout:
        """Gemma's layer, which is not Llama's: what sets it apart, for the C decode step."""
        tables = list(self.rotary.values())
        return DecodeLayout(
            family=type(self).__name__, activation_dtype=self.activation_dtype,
            hidden_size=self.config.hidden_size, embed=self.embed,
            rotary=tables[0] if len(tables) == 1 else None, layers=(), final_norm=self.norm,
            lm_head=self.lm_head, norm=GEMMA_NORM, mlp=GELU_TANH,
            qk_norm=self.config.generation == 3,
            attention_softcap=self.layers[0].self_attn.softcap,
            logit_softcap=self.config.final_logit_softcapping)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
