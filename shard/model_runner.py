"""Turns sequences to compute into the model's flat inputs and attention metadata, owns the KV cache.

Data flow: the engine says, per sequence, which tokens to compute, where its context starts and which
blocks hold it; the runner builds input_ids/positions/slot_mapping/masks, runs the model and returns
logits for the rows asked for.
"""
from __future__ import annotations

import gc
import logging
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shard.kernels.compiled_decode import CompiledDecode, unsupported_reason
from shard.kernels.cuda_graphs import Capture, CudaGraphCapture, GraphedDecode
from shard.kernels import paged_attention
from shard.layers.attention import (AttentionMetadata, DecodeGroup, LayerCache, PrefillLayout,
                                    gather_index)
from shard.kernels import llama_decode_step

log = logging.getLogger("tgi.shard.model_runner")

# Decode attention in PyTorch (where the C kernel does not run) pads every context of a group to the
# group's longest. A sequence joins a group while its context is at most twice the group's shortest,
# or this many tokens longer (padding a few hundred tokens costs less than another round of small
# kernels).
GROUP_SLACK_TOKENS = 512
# A prefilled sequence whose context is at most this long computes its attention in the C decode
# kernel, each new token a row reading the cache up to itself: about twice as fast as PyTorch's CPU
# flash kernel at 128 tokens and 1.2-1.8x at 512, slower from about 1024 (every row rereads its
# whole context).
PREFILL_KERNEL_MAX_CONTEXT = 512


@dataclass(slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_block(self) -> int:
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int) -> list[LayerCache]:
    shape = (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
    return [LayerCache(zeroed(shape, spec.dtype, spec.device),
                       zeroed(shape, spec.dtype, spec.device))
            for _ in range(spec.num_layers)]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros. On the CPU its memory is an anonymous mapping, which the kernel fills
    with zeros page by page as it is first written: a pool sized for the most the server may
    hold (30% of the available memory by default) takes memory as its blocks are used, where
    torch.zeros would write, and keep resident, every page at start."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)  # keeps `pages` alive


@dataclass(slots=True)
class PrefillOutput:
    last: torch.Tensor  # [sequences, vocab]: logits of each sequence's last token
    full: list[torch.Tensor | None]  # [n, vocab] every token, for the rows asked; else None
    hidden: list[torch.Tensor | None]  # [n, hidden] final hidden states, for the same rows
    decode: torch.Tensor | None = None  # [B, vocab]: the running batch's rows, when one rode along
    decode_hidden: torch.Tensor | None = None  # [B, hidden]: the same rows' final hidden states


@dataclass(slots=True)
class DecodeOutput:
    logits: torch.Tensor  # [B, vocab]
    hidden: torch.Tensor  # [B, hidden]: the final hidden states the logits were read from


@dataclass(slots=True)
class DecodeRows:
    """A running batch's next step: one token per sequence at position seq_lens."""

    input_ids: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks]


@dataclass(slots=True)
class PrefillSequence:
    token_ids: list[int]  # the tokens to compute now
    start: int  # tokens of this sequence already in the cache (position of token_ids[0])
    blocks: list[int]
    embeds: torch.Tensor | None = None  # [n, hidden]: given vectors in place of token_ids

    @property
    def length(self) -> int:
        return len(self.token_ids) if self.embeds is None else self.embeds.shape[0]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, spec: KVCacheSpec, *, compile_decode: bool = False,
                 world_size: int = 1, cuda_graphs: list[int] | None = None,
                 new_capture: Callable[[torch.device], Capture] | None = None):
        """cuda_graphs: batch sizes to capture the decode step for on CUDA (see
        shard.kernels.cuda_graphs); `new_capture` replaces the CUDA capture (tests emulate it on the
        CPU)."""
        self.model = model
        self.spec = spec
        self.device = spec.device
        self.world_size = world_size
        self.cache: list[LayerCache] = []
        self.num_blocks = 0
        self.paged_kernel = paged_attention.supports(spec.device, spec.dtype)
        self.decode_step = self._decode_forward
        self.c_step: llama_decode_step.DecodeStep | None = None  # built with each pool (see allocate)
        self.graphs: GraphedDecode | None = None  # captured with each pool (see warm_decode)
        if cuda_graphs and (spec.device.type == "cuda" or new_capture is not None):
            self.graphs = GraphedDecode(self._static_decode_forward, cuda_graphs, spec.device,
                                        block_bytes=spec.bytes_per_block // spec.num_layers,
                                        new_capture=new_capture or CudaGraphCapture)
        if compile_decode:
            reason = unsupported_reason(model, spec.device, world_size)
            if reason is None and not self.paged_kernel:
                reason = "decode attention runs in PyTorch here (no C kernel)"
            if reason is None:
                self.decode_step = CompiledDecode(self._decode_forward)
            else:
                log.warning("the decode step is not compiled: %s", reason)

    def warm_decode(self, max_total_tokens: int = 0) -> None:
        """Compiles the decode step now, when it is to be compiled (see shard.kernels.compiled_decode),
        or captures its CUDA graphs for requests of up to max_total_tokens (prompt and output;
        0: unknown, no graphs)."""
        if isinstance(self.decode_step, CompiledDecode):
            with torch.inference_mode():
                self.decode_step.warm(tables_width=1)
        if self.graphs is None:
            return
        if not max_total_tokens:
            log.warning("no CUDA graphs: the warm-up did not say how long a request may be")
            return
        try:
            with torch.inference_mode():
                # widths from the longest request alone, the same on every rank (each sizes its
                # own pool): a column holds a block id, so a graph wider than a pool has blocks
                # only pads more columns with block 0
                self.graphs.capture(-(-max_total_tokens // self.spec.block_size))
            return
        except Exception as err:
            if self.world_size > 1:  # ranks whose graphs differ would pair collectives wrongly
                self._free_graph_memory()
                raise
            reason = (str(err).strip().splitlines()[0][:300] if str(err).strip()
                      else repr(err))
        # past the except block: the error's traceback held the frames of the half-captured
        # graph, and with them its memory pool, which can only now be given back
        self._free_graph_memory()
        log.warning("the decode step could not be captured in CUDA graphs, it runs eagerly: %s",
                    reason)

    def _free_graph_memory(self) -> None:
        if self.device.type == "cuda":
            gc.collect()  # the graphs' pool is freed with its last reference
            torch.cuda.empty_cache()

    def allocate(self, num_blocks: int) -> None:
        self.c_step = None  # it holds the old pool too
        if self.graphs is not None and self.graphs.captured:
            self.graphs.release()  # captured over the old pool: captured again by warm_decode
            self._free_graph_memory()
        self.cache = []  # free the old pool before allocating the new one
        self.cache = allocate_kv_cache(self.spec, num_blocks)
        self.num_blocks = num_blocks
        # a compiled step or CUDA graphs asked for run instead
        if not isinstance(self.decode_step, CompiledDecode) and self.graphs is None:
            reason = llama_decode_step.unsupported_reason(self.model, self.cache)
            if reason is None:
                self.c_step = llama_decode_step.DecodeStep(self.model, self.cache)
            else:
                log.info("decode steps run layer by layer: %s", reason)

    @torch.inference_mode()
    def prefill(self, seqs: list[PrefillSequence], *, all_logits_rows: set[int] = frozenset(),
                decode: DecodeRows | None = None) -> PrefillOutput:
        """Computes the sequences' tokens (and, with `decode`, one step of a running batch);
        `all_logits_rows` are the sequences whose every position (not only the last) comes back.

        With `decode`, a running batch's next tokens ride in the same forward (TGI's chunking): the
        weights are read once for both, and the running streams advance while the prompt computes.
        """
        device = self.device
        query_lens = [s.length for s in seqs]
        context_lens = [s.start + n for s, n in zip(seqs, query_lens)]
        embeds = self._embeds(seqs)
        positions = torch.cat([torch.arange(s.start, c, dtype=torch.long, device=device)
                               for s, c in zip(seqs, context_lens)])
        num_blocks = -(-max(context_lens) // self.spec.block_size)
        block_tables = _pad_blocks([s.blocks[:num_blocks] for s in seqs], device)
        meta = _metadata(block_tables, positions, query_lens, context_lens, self.spec.block_size)
        short = [c <= PREFILL_KERNEL_MAX_CONTEXT for c in context_lens]
        if self.paged_kernel and any(short):
            seq_of_token = torch.repeat_interleave(torch.arange(len(seqs), device=device),
                                                   torch.tensor(query_lens, device=device))
            meta.prefill.row_tables = block_tables.index_select(0, seq_of_token)
            meta.prefill.row_context_lens = positions + 1
            meta.prefill.kernel_sequences = short
        ends = torch.tensor(query_lens, device=device).cumsum(0)
        starts = ends - torch.tensor(query_lens, device=device)
        rows = []
        for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
            rows.extend(range(start, end) if i in all_logits_rows else [end - 1])
        logit_rows = torch.tensor(rows, dtype=torch.long, device=device)
        num_decode = 0
        if decode is not None:
            num_decode = len(decode.input_ids)
            part = self._decode_metadata(decode.seq_lens, decode.block_tables)
            embeds = torch.cat([self.model.embed(decode.input_ids), embeds])
            positions = torch.cat([decode.seq_lens, positions])
            meta.slot_blocks = torch.cat([part.slot_blocks, meta.slot_blocks])
            meta.slot_offsets = torch.cat([part.slot_offsets, meta.slot_offsets])
            meta.decode_groups, meta.num_decode_rows = part.decode_groups, num_decode
            meta.decode_tables, meta.decode_context_lens = (part.decode_tables,
                                                             part.decode_context_lens)
            logit_rows = torch.cat([torch.arange(num_decode, device=device),
                                    logit_rows + num_decode])
        hidden = self.model(embeds, positions, self.cache, meta, logit_rows)
        logits = self.model.logits(hidden)
        out = PrefillOutput(logits[0:0], [], [])
        if decode is not None:
            out.decode, out.decode_hidden = logits[:num_decode], hidden[:num_decode]
        last, cursor = [], num_decode
        for i, n in enumerate(query_lens):
            width = n if i in all_logits_rows else 1
            chunk = logits[cursor:cursor + width]
            last.append(chunk[-1])
            out.full.append(chunk if i in all_logits_rows else None)
            out.hidden.append(hidden[cursor:cursor + width] if i in all_logits_rows else None)
            cursor += width
        out.last = torch.stack(last)
        return out

    def _embeds(self, seqs: list[PrefillSequence]) -> torch.Tensor:
        """The vectors of every sequence's tokens, given vectors copied over their rows."""
        ids = [t for s in seqs for t in (s.token_ids if s.embeds is None else [0] * s.length)]
        embeds = self.model.embed(torch.tensor(ids, dtype=torch.long, device=self.device))
        start = 0
        for s in seqs:
            if s.embeds is not None:
                embeds[start:start + s.length] = s.embeds.to(embeds.dtype)
            start += s.length
        return embeds

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the keys and values of block `source` into block `destination`, per pair
        (a beam about to write into a block it shares)."""
        if not pairs:
            return
        source = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        destination = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for layer in self.cache:
            layer.key[destination] = layer.key[source]
            layer.value[destination] = layer.value[source]

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
               block_tables: torch.Tensor) -> DecodeOutput:
        """One token per sequence at position seq_lens -> logits [B, vocab] and hidden states."""
        if self.c_step is not None:
            return DecodeOutput(*self.c_step(input_ids, seq_lens, block_tables))
        if self.graphs is not None and self.graphs.captured:
            # the columns the longest context needs (one host sync: the previous step's sampling
            # has already waited for the device)
            width = (int(seq_lens.max()) + 1 + self.spec.block_size - 1) // self.spec.block_size
            out = self.graphs(input_ids, seq_lens, block_tables, width)
            if out is not None:
                return DecodeOutput(*out)
        return DecodeOutput(*self.decode_step(input_ids, seq_lens, block_tables))

    def _decode_forward(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        meta = self._decode_metadata(seq_lens, block_tables)
        return self._forward_rows(input_ids, seq_lens, meta)

    def _forward_rows(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row at position seq_lens -> (logits, final hidden states)."""
        hidden = self.model(self.model.embed(input_ids), seq_lens, self.cache, meta)
        return self.model.logits(hidden), hidden

    def _static_decode_forward(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
                               block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode forward with every shape fixed by its inputs' and nothing read back to the
        host (what a CUDA graph records): each row attends over its table's full width, masked
        past its context."""
        spec = self.spec
        context_lens = seq_lens + 1
        width = block_tables.shape[1]
        index = gather_index(block_tables, width * spec.block_size,
                             (None, spec.num_kv_heads, spec.block_size, spec.head_dim))
        positions = torch.arange(width * spec.block_size, device=seq_lens.device)
        group = DecodeGroup(None, index, positions.unsqueeze(0) < context_lens.unsqueeze(1))
        slot_blocks, slot_offsets = self._slots(seq_lens, block_tables)
        return self._forward_rows(input_ids, seq_lens, AttentionMetadata(
            slot_blocks=slot_blocks, slot_offsets=slot_offsets, block_tables=block_tables,
            decode_groups=[group]))

    def _slots(self, seq_lens: torch.Tensor,
               block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each row's new token is stored: (block, offset in it)."""
        block_size = self.spec.block_size
        blocks = block_tables.gather(1, (seq_lens // block_size).unsqueeze(1)).squeeze(1)
        return blocks, seq_lens % block_size

    def _decode_metadata(self, seq_lens: torch.Tensor,
                         block_tables: torch.Tensor) -> AttentionMetadata:
        spec = self.spec
        context_lens = seq_lens + 1
        slot_blocks, slot_offsets = self._slots(seq_lens, block_tables)
        if self.paged_kernel:  # reads each context where it lies: no groups, no gather indices
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
                row_index = torch.tensor(rows, dtype=torch.long, device=self.device)
                tables = block_tables[row_index, :num_blocks]
                lens = context_lens[row_index]
            positions = torch.arange(num_blocks * spec.block_size, device=self.device)
            index = gather_index(tables, longest,
                                 (None, spec.num_kv_heads, spec.block_size, spec.head_dim))
            decode_groups.append(DecodeGroup(row_index, index,
                                             positions.unsqueeze(0) < lens.unsqueeze(1)))
        return AttentionMetadata(slot_blocks=slot_blocks, slot_offsets=slot_offsets,
                                 block_tables=block_tables, decode_groups=decode_groups)


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


def _pad_blocks(blocks: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(b) for b in blocks)
    return torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.long,
                        device=device)


def _metadata(block_tables: torch.Tensor, positions: torch.Tensor, query_lens: list[int],
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
