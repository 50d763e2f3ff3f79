"""The attention metadata of a forward (shard.layers.attention).

Where each new token's keys and values go and which cached ones each row reads, for a prefill, an
eager decode step and a CUDA graph's fixed-shape step."""
from __future__ import annotations

import torch

from shard.kv_budget import KVCacheSpec
from shard.layers.attention_state import AttentionMetadata, DecodeGroup, PrefillLayout, gather_index

# Decode attention in PyTorch (where the C kernel does not run) pads every context of a group to the
# group's longest. A sequence joins a group while its context is at most twice the group's shortest,
# or this many tokens longer (padding a few hundred tokens costs less than another round of small
# kernels).
GROUP_SLACK_TOKENS = 512
# A prefilled sequence whose context is at most this long computes its attention in the C decode
# kernel, each new token a row reading the cache up to itself: faster than PyTorch's CPU flash kernel
# for short contexts, slower for long ones, where every row rereads its whole context.
PREFILL_KERNEL_MAX_CONTEXT = 512


def prefill_metadata(block_tables: torch.Tensor, positions: torch.Tensor, query_lens: list[int],
                     context_lens: list[int], block_size: int) -> AttentionMetadata:
    """Metadata for sequences with several new tokens each (prefill or chunked prefill)."""
    device = positions.device
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens), device=device),
                                           torch.tensor(query_lens, device=device))
    slot_blocks = block_tables[seq_of_token, positions // block_size]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    layout = PrefillLayout(query_starts=starts,
                           cached_lens=[c - n for c, n in zip(context_lens, query_lens)])
    return AttentionMetadata(slot_blocks=slot_blocks, slot_offsets=positions % block_size,
                             block_tables=block_tables, prefill=layout)


def route_short_contexts(meta: AttentionMetadata, block_tables: torch.Tensor,
                         positions: torch.Tensor, query_lens: list[int],
                         context_lens: list[int]) -> None:
    """The marking of the sequences whose attention runs in the C kernel.

    See PREFILL_KERNEL_MAX_CONTEXT. Where the kernel runs, each new token of those sequences becomes
    a row of its own."""
    short = [c <= PREFILL_KERNEL_MAX_CONTEXT for c in context_lens]
    if not any(short):
        return
    device = positions.device
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens), device=device),
                                           torch.tensor(query_lens, device=device))
    meta.prefill.row_tables = block_tables.index_select(0, seq_of_token)
    meta.prefill.row_context_lens = positions + 1
    meta.prefill.kernel_sequences = short


def decode_metadata(seq_lens: torch.Tensor, block_tables: torch.Tensor, spec: KVCacheSpec,
                    paged_kernel: bool) -> AttentionMetadata:
    """Metadata for one new token per row at position seq_lens."""
    context_lens = seq_lens + 1
    slot_blocks, slot_offsets = slots(seq_lens, block_tables, spec.block_size)
    if paged_kernel:  # reads each context where it lies: no groups, no gather indices
        return AttentionMetadata(slot_blocks=slot_blocks, slot_offsets=slot_offsets,
                                 block_tables=block_tables, decode_tables=block_tables,
                                 decode_context_lens=context_lens)
    lengths = context_lens.tolist()
    groups = group_by_context(lengths)
    decode_groups = []
    for rows in groups:
        longest = max(lengths[r] for r in rows)
        num_blocks = -(-longest // spec.block_size)
        if len(groups) == 1:
            row_index, tables, lens = None, block_tables[:, :num_blocks], context_lens
        else:
            row_index = torch.tensor(rows, dtype=torch.long, device=spec.device)
            tables = block_tables[row_index, :num_blocks]
            lens = context_lens[row_index]
        positions = torch.arange(num_blocks * spec.block_size, device=spec.device)
        index = gather_index(tables, longest,
                             (None, spec.num_kv_heads, spec.block_size, spec.head_dim))
        decode_groups.append(DecodeGroup(row_index, index,
                                         positions.unsqueeze(0) < lens.unsqueeze(1)))
    return AttentionMetadata(slot_blocks=slot_blocks, slot_offsets=slot_offsets,
                             block_tables=block_tables, decode_groups=decode_groups)


def static_decode_metadata(seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           spec: KVCacheSpec, in_place: bool = False) -> AttentionMetadata:
    """Decode metadata with every shape fixed by its inputs' and nothing read back to the host.

    What a CUDA graph records: each row attends over its table's full width, masked past its
    context; or, `in_place` (a kernel reading the cache where it lies, Triton's), over its
    context alone, its length read on the device."""
    context_lens = seq_lens + 1
    if in_place:
        return decode_metadata(seq_lens, block_tables, spec, paged_kernel=True)
    width = block_tables.shape[1]
    index = gather_index(block_tables, width * spec.block_size,
                         (None, spec.num_kv_heads, spec.block_size, spec.head_dim))
    positions = torch.arange(width * spec.block_size, device=seq_lens.device)
    group = DecodeGroup(None, index, positions.unsqueeze(0) < context_lens.unsqueeze(1))
    slot_blocks, slot_offsets = slots(seq_lens, block_tables, spec.block_size)
    return AttentionMetadata(slot_blocks=slot_blocks, slot_offsets=slot_offsets,
                             block_tables=block_tables, decode_groups=[group])


def slots(seq_lens: torch.Tensor, block_tables: torch.Tensor,
          block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row's new token is stored: (block, offset in it)."""
    blocks = block_tables.gather(1, (seq_lens // block_size).unsqueeze(1)).squeeze(1)
    return blocks, seq_lens % block_size


def group_by_context(lengths: list[int]) -> list[list[int]]:
    """Rows of the batch grouped by similar context length (see GROUP_SLACK_TOKENS), shortest first."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    shortest = 0
    for row in order:
        length = lengths[row]
        if groups and length <= max(2 * shortest, shortest + GROUP_SLACK_TOKENS):
            groups[-1].append(row)
        else:
            groups.append([row])
            shortest = length
    return groups


def pad_blocks(blocks: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables of different lengths as one tensor, padded with block 0."""
    width = max(len(b) for b in blocks)
    return torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.long,
                        device=device)
