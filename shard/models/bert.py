"""BERT, the encoder of all-MiniLM, bge and e5: it only embeds.

Word, position and token-type embeddings summed and normed; post-norm layers of bidirectional
attention and a GELU feed-forward block. There is no KV cache: every token of an input attends to
every other, and nothing is kept after the forward. Linear layers go through the shard's own (its
bf16 matmul), the heads split across ranks as a decoder's are; with --quantize int8, through
fbgemm's int8 matmuls (shard.layers.int8_dynamic), on any number of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from shard.partition import RankHeads
from shard.weights import Weights

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# each activation as oneDNN fuses it into a matmul: (attr, algorithm)
_FUSED = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"),
          "gelu_pytorch_tanh": ("gelu", "tanh"), "relu": ("relu", "")}
# the rows oneDNN's packed layout is chosen for: a batch of prompts, not a decode step
_PACKED_ROWS = 4096


@dataclass(slots=True, kw_only=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, cfg: dict) -> "BertConfig":
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"BERT with {cfg['position_embedding_type']!r} position embeddings "
                             "is not supported (absolute ones are)")
        if cfg.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise ValueError(f"BERT activation {cfg['hidden_act']!r} is not supported "
                             f"({', '.join(_ACTIVATIONS)} are)")
        names = [f for f in cls.__dataclass_fields__ if f in cfg]
        return cls(**{name: cfg[name] for name in names})


def _layer_norm(weights: Weights, prefix: str, eps: float) -> nn.LayerNorm:
    hidden = weights.get(f"{prefix}.weight").shape[0]
    norm = nn.LayerNorm(hidden, eps=eps, device=weights.device, dtype=torch.float32)
    norm.weight.data.copy_(weights.get(f"{prefix}.weight").float())
    norm.bias.data.copy_(weights.get(f"{prefix}.bias").float())
    return norm.requires_grad_(False)


def _normed(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """The norm computed in float32, back in the activations' dtype."""
    return norm(x.float()).to(x.dtype)


class _Dense(nn.Module):
    """A linear layer of the encoder, with its activation where given.

    On the CPU in float32, on one rank, oneDNN's packed form with the activation fused into the
    matmul: MiniLM's forward of 32 x 128 tokens took 345 ms so against 430 ms through F.linear
    (benchmarks/RESULTS.md). Elsewhere the shard's own layer (bf16 kernels, ranks, --quantize
    int8's form), the activation after it."""

    def __init__(self, layer: nn.Module, activation: str | None = None, *, ranks: int = 1):
        super().__init__()
        self.layer, self.activation = layer, activation
        weight = layer.prepared.weight
        bias = layer.prepared.bias if layer.prepared.bias is not None else layer.bias
        self.packed = self.bias = None
        if (ranks == 1 and weight is not None and weight.device.type == "cpu"
                and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKED_ROWS)
            self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out]."""
        if self.packed is None or self.layer.lora is not None:
            out = self.layer(x)
            return out if self.activation is None else _ACTIVATIONS[self.activation](out)
        attr, algorithm = _FUSED[self.activation] if self.activation else ("none", "")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, attr, [], algorithm)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, heads: RankHeads, weights: Weights, prefix: str):
        super().__init__()
        attention = f"{prefix}.attention"
        ranks = weights.parallel.world_size
        self.qkv = _Dense(ColumnParallelLinear.load(
            weights, [f"{attention}.self.{name}" for name in ("query", "key", "value")],
            bias=True), ranks=ranks)
        self.out = _Dense(RowParallelLinear.load(weights, f"{attention}.output.dense", bias=True),
                          ranks=ranks)
        self.attention_norm = _layer_norm(weights, f"{attention}.output.LayerNorm",
                                          cfg.layer_norm_eps)
        self.up = _Dense(ColumnParallelLinear.load(weights, [f"{prefix}.intermediate.dense"],
                                                   bias=True), cfg.hidden_act, ranks=ranks)
        self.down = _Dense(RowParallelLinear.load(weights, f"{prefix}.output.dense", bias=True),
                           ranks=ranks)
        self.output_norm = _layer_norm(weights, f"{prefix}.output.LayerNorm", cfg.layer_norm_eps)
        self.num_heads, self.head_dim = heads.num_heads, cfg.head_dim

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """hidden [B, L, hidden]; mask [B, 1, 1, L] True where a key is a real token (None: all)."""
        batch, length, width = hidden.shape
        flat = hidden.view(batch * length, width)
        q, k, v = (self.qkv(flat).view(batch, length, 3, self.num_heads, self.head_dim)
                   .permute(2, 0, 3, 1, 4))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attended = attended.transpose(1, 2).reshape(batch * length, self.num_heads * self.head_dim)
        flat = _normed(self.attention_norm, self.out(attended) + flat)
        flat = _normed(self.output_norm, self.down(self.up(flat)) + flat)
        return flat.view(batch, length, width)


class BertModel(nn.Module):
    """Encodes padded batches of token ids; the final hidden state of every token comes back."""

    is_encoder = True  # embeds only: no KV cache, no logits

    def __init__(self, cfg: BertConfig, heads: RankHeads, weights: Weights):
        super().__init__()
        self.config = cfg
        self.activation_dtype = weights.activation_dtype
        # BertModel's own checkpoints name no prefix; those saved from a task model say "bert."
        root = "bert." if weights.has("bert.embeddings.word_embeddings.weight") else ""
        embeddings = f"{root}embeddings"
        dtype = weights.activation_dtype
        self.word = weights.get(f"{embeddings}.word_embeddings.weight").to(dtype)
        self.position = weights.get(f"{embeddings}.position_embeddings.weight").to(dtype)
        self.token_type = weights.get(f"{embeddings}.token_type_embeddings.weight").to(dtype)
        self.embedding_norm = _layer_norm(weights, f"{embeddings}.LayerNorm", cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg, heads, weights, f"{root}encoder.layer.{i}")
                                    for i in range(cfg.num_hidden_layers))

    @torch.inference_mode()
    def encode(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] (padded at the end), lengths [B] -> final hidden states [B, L, hidden].

        The rows past each input's length hold padding's states, which no real token attended to."""
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)
        hidden = self.word[input_ids] + self.position[positions] + self.token_type[0]
        hidden = _normed(self.embedding_norm, hidden)
        mask = None
        if bool((lengths < length).any()):
            mask = (positions[None, :] < lengths[:, None]).view(len(lengths), 1, 1, length)
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return hidden
