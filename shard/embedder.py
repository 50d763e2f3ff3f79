"""Embeddings: inputs computed together and pooled, their keys and values dropped with the forward.

An encoder (BERT) runs its padded batch bidirectionally. A decoder runs the prefill forward over a
scratch KV cache sized to the call's tokens and freed with it, so the pool the router accounts
for, and the batches it holds, are never touched: an Embed call only takes turns with the steps on
the engine thread. A decoder's long input may come in chunks, as a long prompt is prefilled, so
that no call holds a running batch back for long: its scratch cache and final hidden states so far
are kept under its id until its last chunk.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from shard.attention_inputs import pad_blocks, prefill_metadata
from shard.kv_budget import KVCacheSpec, allocate_kv_cache
from shard.pooling import PoolingConfig, pool


@dataclass(slots=True)
class EmbedInput:
    id: int
    ids: list[int]  # the whole input, whichever chunk is computed now
    start: int = 0  # tokens earlier calls computed
    end: int | None = None  # where this call's chunk stops; None: the input's end

    @property
    def stop(self) -> int:
        return len(self.ids) if self.end is None else min(self.end, len(self.ids))

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == len(self.ids)


@dataclass(slots=True)
class _Chunked:
    """A decoder's input computed in chunks: its scratch cache and final hidden states so far."""

    cache: list
    blocks: list[int]
    done: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)


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
        self.chunked: dict[int, _Chunked] = {}  # by input id, until its last chunk

    def embed(self, inputs: list[EmbedInput | tuple[int, list[int]]]) -> EmbedOutput:
        """Each input's pooled vector once its last token is computed, or why it was refused.

        A chunk short of its input's end answers nothing: the input is kept for the next."""
        out = EmbedOutput()
        inputs = [i if isinstance(i, EmbedInput) else EmbedInput(*i) for i in inputs]
        if not self.pooling.mode:
            out.rejected = [(i.id, f"this model cannot embed: {self.pooling.why_not}")
                            for i in inputs]
            return out
        taken = []
        for item in inputs:
            why = self._refusal(item)
            if why is None:
                taken.append(item)
            else:
                self.chunked.pop(item.id, None)
                out.rejected.append((item.id, why))
        start = time.perf_counter_ns()
        with torch.inference_mode():
            whole = [item for item in taken if item.whole]
            if whole:
                pairs = [(item.id, item.ids) for item in whole]
                states = self._encode(pairs) if self.is_encoder else self._prefill(pairs)
                for item, hidden in zip(whole, states):
                    out.vectors[item.id] = pool(hidden, self.pooling.mode).cpu()
            for item in taken:
                if not item.whole:
                    hidden = self._chunk(item)
                    if hidden is not None:
                        out.vectors[item.id] = pool(hidden, self.pooling.mode).cpu()
        out.forward_ns = time.perf_counter_ns() - start
        return out

    def clear(self) -> None:
        """Drops the inputs whose chunks were kept (ClearCache of every batch)."""
        self.chunked.clear()

    def _refusal(self, item: EmbedInput) -> str | None:
        ids = item.ids
        if item.whole:
            self.chunked.pop(item.id, None)
        elif self.is_encoder:
            return "an encoder computes an input whole, never in chunks"
        elif not item.start < item.stop:
            return f"an empty chunk ({item.start} to {item.stop}) of an input of {len(ids)}"
        elif item.start and (item.id not in self.chunked
                             or self.chunked[item.id].done != item.start):
            return f"input {item.id}'s chunk from token {item.start} continues no chunk kept"
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

    def _chunk(self, item: EmbedInput) -> torch.Tensor | None:
        """A chunk of a decoder's input over its kept cache: all its final states at the last."""
        block_size = self.spec.block_size
        if item.start == 0:
            count = -(-len(item.ids) // block_size)
            self.chunked[item.id] = _Chunked(allocate_kv_cache(self.spec, count),
                                             list(range(count)))
        kept, device = self.chunked[item.id], self.spec.device
        positions = torch.arange(item.start, item.stop, dtype=torch.long, device=device)
        meta = prefill_metadata(pad_blocks([kept.blocks], device), positions,
                                [item.stop - item.start], [item.stop], block_size)
        ids = torch.tensor(item.ids[item.start:item.stop], dtype=torch.long, device=device)
        kept.rows.append(self.model(self.model.embed(ids), positions, kept.cache, meta))
        kept.done = item.stop
        if item.stop < len(item.ids):
            return None
        del self.chunked[item.id]
        return torch.cat(kept.rows)
