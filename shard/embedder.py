"""Embeddings: inputs computed together and pooled, their keys and values dropped with the forward.

An encoder (BERT) runs its padded batch bidirectionally. A decoder runs the prefill forward over a
scratch KV cache sized to the call's tokens and freed with it, so the pool the router accounts
for, and the batches it holds, are never touched: an Embed call only takes turns with the steps on
the engine thread.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from shard.attention_inputs import pad_blocks, prefill_metadata
from shard.kv_budget import KVCacheSpec, allocate_kv_cache
from shard.pooling import PoolingConfig, pool


@dataclass(slots=True)
class EmbedOutput:
    vectors: dict[int, torch.Tensor] = field(default_factory=dict)  # id -> [hidden] float32
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (id, why)
    forward_ns: int = 0


class Embedder:
    def __init__(self, model: torch.nn.Module, spec: KVCacheSpec, pooling: PoolingConfig,
                 vocab_size: int, max_tokens: int):
        self.model = model
        self.spec = spec
        self.pooling = pooling
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens  # the longest input taken
        self.is_encoder = bool(getattr(model, "is_encoder", False))

    def embed(self, inputs: list[tuple[int, list[int]]]) -> EmbedOutput:
        """(id, token ids) -> each input's pooled vector, or why it was refused."""
        out = EmbedOutput()
        if not self.pooling.mode:
            out.rejected = [(i, f"this model cannot embed: {self.pooling.why_not}")
                            for i, _ in inputs]
            return out
        taken = []
        for request_id, ids in inputs:
            why = self._refusal(ids)
            if why is None:
                taken.append((request_id, ids))
            else:
                out.rejected.append((request_id, why))
        if not taken:
            return out
        start = time.perf_counter_ns()
        with torch.inference_mode():
            states = (self._encode(taken) if self.is_encoder else self._prefill(taken))
            for (request_id, _), hidden in zip(taken, states):
                out.vectors[request_id] = pool(hidden, self.pooling.mode).cpu()
        out.forward_ns = time.perf_counter_ns() - start
        return out

    def _refusal(self, ids: list[int]) -> str | None:
        if not ids:
            return "an input to embed must hold at least one token"
        if len(ids) > self.max_tokens:
            return f"an input of {len(ids)} tokens is longer than the {self.max_tokens} this " \
                   "model embeds"
        if max(ids) >= self.vocab_size:
            return f"token id {max(ids)} is not below the vocabulary's {self.vocab_size}"
        return None

    def _encode(self, inputs: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """An encoder's final hidden states [n, hidden] of each input, padded together."""
        device = self.spec.device
        longest = max(len(ids) for _, ids in inputs)
        pad = getattr(self.model.config, "pad_token_id", 0) or 0
        batch = torch.tensor([ids + [pad] * (longest - len(ids)) for _, ids in inputs],
                             dtype=torch.long, device=device)
        lengths = torch.tensor([len(ids) for _, ids in inputs], dtype=torch.long, device=device)
        hidden = self.model.encode(batch, lengths)
        return [hidden[row, :len(ids)] for row, (_, ids) in enumerate(inputs)]

    def _prefill(self, inputs: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """A decoder's final normed hidden states of each input, over a scratch KV cache."""
        device, block_size = self.spec.device, self.spec.block_size
        lengths = [len(ids) for _, ids in inputs]
        tables, next_block = [], 0
        for n in lengths:
            count = -(-n // block_size)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        cache = allocate_kv_cache(self.spec, next_block)
        positions = torch.cat([torch.arange(n, dtype=torch.long, device=device)
                               for n in lengths])
        meta = prefill_metadata(pad_blocks(tables, device), positions, lengths, lengths,
                                block_size)
        ids = torch.tensor([t for _, seq in inputs for t in seq], dtype=torch.long, device=device)
        hidden = self.model(self.model.embed(ids), positions, cache, meta)
        return list(hidden.split(lengths))
