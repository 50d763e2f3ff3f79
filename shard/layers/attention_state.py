"""The paged KV cache of one layer and what a forward tells attention about its rows.

A layer's keys and values lie in fixed-size blocks ([blocks, kv_heads, block_size, d]); each
sequence's are found by its block table. shard.layers.attention attends over them; the kernels
(shard.kernels) read them where they lie.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shard.layers import kv_int8


@dataclass(slots=True)
class PrefillLayout:
    """Where each sequence's new tokens sit in the flat batch (host-side lists, one entry per sequence)."""

    query_starts: list[int]  # flat index of each sequence's first new token; one extra at the end
    cached_lens: list[int]  # tokens of the sequence already in the cache before this forward
    # where the C kernel runs: every new token as a row of its own reading the cache up to itself,
    # [T, blocks] block ids and [T] context lengths, for the sequences marked in kernel_sequences
    # (short contexts, see PREFILL_KERNEL_MAX_CONTEXT); the others, or all when None, attend
    # sequence by sequence in PyTorch
    row_tables: torch.Tensor | None = None
    row_context_lens: torch.Tensor | None = None
    kernel_sequences: list[bool] | None = None
    # per sequence, the [start, end) positions of each image whose tokens attend to one another
    # both ways (Gemma 3's); None: every sequence is causal
    image_spans: list[list[tuple[int, int]]] | None = None
    # their [queries, keys] masks, built by the first layer that needs each and read by the rest
    # (keyed by what a mask depends on: cached, new tokens, window, spans)
    image_masks: dict = field(default_factory=dict)
    # Triton's prefill kernel's tile lists on the device, uploaded by the first layer (CUDA)
    tile_index: dict = field(default_factory=dict)


@dataclass(slots=True)
class DecodeGroup:
    """Decoding sequences of similar context length, attended together padded to the longest.

    One group per step when lengths are alike, more when a long context would otherwise make every
    short one gather and score its length."""

    rows: torch.Tensor | None  # [G] rows of the batch in this group; None: the whole batch
    gather_index: torch.Tensor  # [G, kv_heads, blocks]: rows of the flattened cache to gather
    mask: torch.Tensor  # [G, blocks * block_size]: which gathered positions hold real tokens


@dataclass(slots=True)
class AttentionMetadata:
    """Where the tokens of one forward sit in the batch and in the KV cache."""

    slot_blocks: torch.Tensor  # [T] block holding each new token's keys and values
    slot_offsets: torch.Tensor  # [T] its position inside that block
    block_tables: torch.Tensor  # [B, max_blocks] block ids per sequence (padding repeats a valid id)
    decode_groups: list[DecodeGroup] | None = None  # rows with one new token each
    # or, where a kernel reads the cache in place (C on the CPU, Triton on CUDA), those rows read
    # straight from it: [B, blocks] block ids and [B] context lengths, nothing gathered
    decode_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    prefill: PrefillLayout | None = None  # rows of sequences with several new tokens
    # with both: the first num_decode_rows rows decode, the rest prefill (a running batch riding
    # in a prefill's forward); slot_* cover every row, the prefill layout indexes the rest only
    num_decode_rows: int = 0


@dataclass(slots=True)
class LayerCache:
    # [num_blocks, kv_heads, block_size, head_dim]: a block's keys are contiguous per head, so the
    # context of a sequence gathers into [kv_heads, tokens, head_dim] without a transpose copy
    key: torch.Tensor
    value: torch.Tensor
    # an int8 cache's float32 scales [num_blocks, kv_heads, block_size], one a row
    # (shard.layers.kv_int8); None for a cache in the model's dtype
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None

    @property
    def is_int8(self) -> bool:
        return self.key_scale is not None

    def gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, kv_heads, blocks * block_size, d] of each sequence's context.

        Read at gather_index's rows: the cache's rows, or an int8 cache's dequantized to float32."""
        if self.key_scale is None:
            return gather_blocks(self.key, index), gather_blocks(self.value, index)
        return (kv_int8.gather_dequantized(self.key, self.key_scale, index),
                kv_int8.gather_dequantized(self.value, self.value_scale, index))


def gather_index(block_tables: torch.Tensor, length: int, cache_shape) -> torch.Tensor:
    """The cache rows [B, kv_heads, blocks] holding `length` tokens of each sequence.

    Rows of the flattened [blocks * kv_heads, block_size, d] cache."""
    _, num_kv_heads, block_size, _ = cache_shape
    needed = -(-length // block_size)
    heads = torch.arange(num_kv_heads, device=block_tables.device).view(1, -1, 1)
    return block_tables[:, None, :needed] * num_kv_heads + heads


def gather_blocks(blocks: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B, kv_heads, blocks * block_size, d]: each sequence's context, contiguous."""
    _, _, block_size, head_dim = blocks.shape
    batch, num_kv_heads, needed = index.shape
    # index_select copies whole rows with a dedicated kernel, faster than advanced indexing here
    rows = blocks.view(-1, block_size * head_dim).index_select(0, index.reshape(-1))
    return rows.view(batch, num_kv_heads, needed * block_size, head_dim)
