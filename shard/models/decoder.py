"""What the pre-norm decoder families share once their layers are built.

One rotary table for every layer, a residual stream each layer's output joins through the next norm,
a final norm and an LM head (tied to the embeddings where the checkpoint says so or holds none of
its own).
"""
from __future__ import annotations

import torch
from torch import nn

from shard.layers.attention_state import AttentionMetadata, LayerCache
from shard.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shard.weights import Weights


def load_lm_head(weights: Weights, embed_tokens: VocabParallelEmbedding, *, tied: bool,
                 vocab_size: int) -> ParallelLMHead:
    if tied or not weights.has("lm_head.weight"):
        return ParallelLMHead.tied(embed_tokens, weights, "model.embed_tokens.weight", vocab_size)
    return ParallelLMHead.load(weights, "lm_head.weight", vocab_size)


class DecoderLM(nn.Module):
    """A pre-norm decoder's forward over the modules a subclass builds.

    A subclass builds `embed_tokens`, `rotary`, `layers` (each called as
    layer(hidden, residual, angles, cache, meta) -> (output, residual)), `norm`, `lm_head` and
    `activation_dtype`."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> the vectors the first layer reads [T, hidden]."""
        return self.embed_tokens(input_ids).to(self.activation_dtype)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: AttentionMetadata, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [T, hidden], positions [T] -> the final normed hidden states.

        Those of the rows in logit_index (all T without it), which `logits` turns into scores."""
        hidden, residual = embeds.to(self.activation_dtype), None
        angles = self.rotary(positions)
        for layer, cache in zip(self.layers, caches):
            hidden, residual = layer(hidden, residual, angles, cache, meta)
        if logit_index is not None:
            hidden = hidden[logit_index]
            residual = residual[logit_index] if residual is not None else None
        return self.norm(hidden) if residual is None else self.norm.add_norm(hidden, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
