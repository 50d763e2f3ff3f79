"""Token embedding and LM head with the vocabulary split across ranks."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shard.distributed import ParallelContext, all_gather_last_dim, all_reduce
from shard.kernels import int8_matmul
from shard.layers.ggml_quants import BlockRows, BlockStack
from shard.layers.ggml_types import BLOCK_TYPES
from shard.layers.linear import LinearWeight, linear
from shard.weights import Weights


def _vocab_slice(weights: Weights, name: str, *, as_stored: bool = False
                 ) -> tuple[torch.Tensor | BlockStack, int]:
    """This rank's rows of a [vocab, hidden] tensor, zero-padded so every rank holds as many.

    A GGUF's blocks, `as_stored`, as a BlockStack."""
    ctx = weights.parallel
    vocab = weights.shape(name)[0]
    block = -(-vocab // ctx.world_size) if ctx.is_sharded else vocab
    start = ctx.rank * block
    part = weights.get_rows(name, start, min(start + block, vocab), as_stored=as_stored)
    if isinstance(part, BlockRows):
        part = BlockStack((part,))
        return (part.padded(block) if part.rows < block else part), start
    if part.shape[0] < block:
        part = torch.cat([part, part.new_zeros(block - part.shape[0], part.shape[1])])
    return part.contiguous(), start


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding matrix by token id; a GGUF's blocks dequantized row by row."""

    def __init__(self, weight: torch.Tensor | BlockStack, start: int, parallel: ParallelContext,
                 dtype: torch.dtype | None = None):
        super().__init__()
        # a GGUF's blocks are held as stored (`blocks`), each lookup's rows dequantized to `dtype`
        self.blocks = weight if isinstance(weight, BlockStack) else None
        self.weight = (None if self.blocks is not None
                       else nn.Parameter(weight, requires_grad=False))
        self.kinds = self.blocks.kinds if self.blocks is not None else ()  # the GGUF types
        self.rows = weight.rows if self.blocks is not None else weight.shape[0]
        # a tied head's int8 kernel form of the same blocks, which lookups then read instead
        self.head_form: torch.Tensor | None = None
        self.dtype = dtype
        self.start = start
        self.parallel = parallel

    @classmethod
    def load(cls, weights: Weights, name: str) -> "VocabParallelEmbedding":
        weight, start = _vocab_slice(weights, name, as_stored=name in weights.blocks)
        return cls(weight, start, weights.parallel, weights.dtype)

    def read_from_head(self, head: LinearWeight) -> bool:
        """Lookups from a tied head's int8 kernel form, the blocks let go; whether it was one.

        The same weights (the form restores the blocks exactly, as GGUF dequantizes them), held
        once: Gemma 3 270M's Q8_0 matrix is 178 MB, most of the file."""
        form = head.quantized
        # a GGUF's types only: a quantized checkpoint's groups may hold their inputs permuted
        if self.blocks is None or form is None or form.kernel != "c8" \
                or form.out_features != self.rows \
                or not all(kind in BLOCK_TYPES for kind in self.kinds):
            return False
        self.head_form, self.blocks = form.data, None
        return True

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.head_form is not None:
            rows = int8_matmul.rows(self.head_form, ids.reshape(-1)).to(self.dtype)
        elif self.blocks is None:
            return F.embedding(ids, self.weight)
        else:
            rows = self.blocks.take(ids.reshape(-1)).dequantize(self.dtype)
        return rows.reshape(*ids.shape, rows.shape[-1])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.is_sharded:
            return self._lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = self._lookup(local.clamp(0, self.rows - 1))
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.parallel)


class ParallelLMHead(nn.Module):
    """Logits for the whole vocabulary on every rank (each computes its rows, then all-gather)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, parallel: ParallelContext,
                 quantize_kind: str | None = None, model_dtype: torch.dtype | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.parallel = parallel
        self.prepared = LinearWeight.prepare(weight, quantize_kind=quantize_kind,
                                             model_dtype=model_dtype)

    @classmethod
    def load(cls, weights: Weights, name: str, vocab_size: int) -> "ParallelLMHead":
        weight, _ = _vocab_slice(weights, name, as_stored=weights.quantizing)
        # the head's error lands on every logit at once: int4 models keep an int8 head, as GGUF's
        # 4-bit files keep theirs at 8 bits (perplexity in benchmarks/RESULTS.md); fp8 ones keep
        # it in the model's dtype, as TGI's and vLLM's fp8 do
        kind = {"int4": "int8", "fp8": None}.get(weights.quantize, weights.quantize)
        return cls(weight, vocab_size, weights.parallel, kind, weights.dtype)

    @classmethod
    def tied(cls, embedding: VocabParallelEmbedding, weights: Weights, name: str,
             vocab_size: int) -> "ParallelLMHead":
        """A head that shares the embedding's matrix.

        Quantized, the head holds its own quantized copy and the embedding lookup keeps the
        full-precision rows, unless they are a GGUF's blocks that the head's int8 kernel form
        holds exactly: lookups then read that form."""
        if weights.quantizing:
            head = cls.load(weights, name, vocab_size)
            embedding.read_from_head(head.prepared)
            return head
        return cls(embedding.weight, vocab_size, embedding.parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(linear(hidden, self.prepared), self.parallel)
        return logits[..., : self.vocab_size]
