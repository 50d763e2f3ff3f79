"""Runs the model's forwards over the KV cache it owns.

A prefill's sequences (a running batch riding along) and decode steps, each by the path
`ModelRunner.decode_path` chooses; logits for the rows asked.
"""
from __future__ import annotations

import enum
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shard.adapters.adapter_set import AdapterSet
from shard.attention_inputs import (decode_metadata, pad_blocks, prefill_metadata,
                                    route_short_contexts, static_decode_metadata)
from shard.decode_paths import c_step
from shard.decode_paths.compiled import CompiledDecode, unsupported_reason
from shard.decode_paths.cuda_graphs import (Capture, CudaGraphCapture, GraphedDecode,
                                            largest_decode_batch)
from shard.kernels import decode_backend
from shard.kv_budget import KVCacheSpec, allocate_kv_cache
from shard.layers.attention_state import AttentionMetadata, LayerCache
from shard.malloc_tuning import return_freed_memory
from shard.prefill_embeds import mark_image_spans, prefill_embeds
from shard.prefill_sequence import PrefillSequence, forward_positions, with_riding_rows

log = logging.getLogger("tgi.shard.model_runner")


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
    adapter_slots: torch.Tensor | None = None  # [B] each row's LoRA slot (-1: none); None: none
    rope_deltas: torch.Tensor | None = None  # [B] each row's position minus seq_lens; None: 0


class DecodePath(enum.Enum):
    """The step that computes a decode (ModelRunner.decode_path chooses)."""

    C_STEP = "c_step"  # shard.decode_paths.c_step: the whole step in one C call
    CUDA_GRAPHS = "cuda_graphs"  # shard.decode_paths.cuda_graphs: a captured graph replayed
    COMPILED = "compiled"  # shard.decode_paths.compiled: the torch.compile'd forward
    EAGER = "eager"  # the forward layer by layer in PyTorch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, spec: KVCacheSpec, *, compile_decode: bool = False,
                 world_size: int = 1, cuda_graphs: list[int] | str | None = None,
                 new_capture: Callable[[torch.device], Capture] | None = None):
        """A runner of `model` over a KV cache laid out as `spec` (allocated by `allocate`).

        cuda_graphs: batch sizes to capture the decode step for on CUDA, or AUTO_CUDA_GRAPHS
        (see shard.decode_paths.cuda_graphs); `new_capture` replaces the CUDA capture (tests
        emulate it on the CPU)."""
        self.model = model
        self.adapters = AdapterSet(model)  # the LoRA adapters loaded on it
        self.spec = spec
        self.device = spec.device
        self.world_size = world_size
        self.cache: list[LayerCache] = []
        self.num_blocks = 0
        # the kernel reading the cache in place at decode (C, Triton or none: decode_backend)
        self.attention_kernel = decode_backend.select_checked(spec, model)
        refusal = decode_backend.cache_refusal(
            spec.device, spec.cache_dtype, self.attention_kernel, compile_decode=compile_decode,
            cuda_graphs=bool(cuda_graphs and (spec.device.type == "cuda" or new_capture)))
        if refusal is not None:
            raise ValueError(refusal)
        self.paged_kernel = self.attention_kernel is not None
        self.decode_step = self._decode_forward
        self.c_step: c_step.DecodeStep | None = None  # built with each pool (see allocate)
        self.graphs: GraphedDecode | None = None  # captured with each pool (see warm_decode)
        if cuda_graphs and (spec.device.type == "cuda" or new_capture is not None):
            # Triton's kernel gathers nothing: block_bytes 0
            gathered = self.attention_kernel != decode_backend.TRITON
            self.graphs = GraphedDecode(self._static_decode_forward, cuda_graphs, spec.device,
                                        block_bytes=gathered * spec.bytes_per_block
                                        // spec.num_layers, block_size=spec.block_size,
                                        new_capture=new_capture or CudaGraphCapture)
        if compile_decode:
            reason = unsupported_reason(model, spec.device, world_size)
            if reason is None and self.attention_kernel != decode_backend.C:
                reason = "decode attention runs in PyTorch here (no C kernel)"
            if reason is None:
                self.decode_step = CompiledDecode(self._decode_forward)
            else:
                log.warning("the decode step is not compiled: %s", reason)

    def warm_decode(self, max_total_tokens: int = 0, max_batch_size: int | None = None) -> None:
        """Compiles the decode step, or captures its CUDA graphs, now, when either was asked for.

        Compiled: see shard.decode_paths.compiled. The graphs are captured for requests of up to
        max_total_tokens (prompt and output; 0: unknown, no graphs), in batches of up to
        max_batch_size requests (the router's --max-batch-size; None: what the pool holds)."""
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
                # own pool): a graph wider than a pool has blocks only pads columns with block 0
                self.graphs.capture(-(-max_total_tokens // self.spec.block_size),
                                    largest_decode_batch(self.num_blocks, max_batch_size,
                                                         ranks=self.world_size))
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

    def adapters_changed(self) -> None:
        """After an unload: nothing keeps the freed stacks, and their memory goes back.

        The C step points into the stacks until it next looks; glibc keeps freed memory in the
        process (shard/malloc_tuning.py), and the CUDA allocator in its cache."""
        if self.c_step is not None:
            self.c_step.follow_adapters()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            return_freed_memory()

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
            declare = getattr(self.model, "decode_layout", None)
            layout = declare() if declare is not None else None
            reason = (c_step.unsupported_reason(layout, self.cache) if layout is not None
                      else "the model family declares no decode layout")
            if reason is None:
                self.c_step = c_step.DecodeStep(layout, self.cache, self.adapters)
            else:
                log.info("decode steps run layer by layer: %s", reason)

    @torch.inference_mode()
    def prefill(self, seqs: list[PrefillSequence], *, all_logits_rows: set[int] = frozenset(),
                hidden_only_rows: set[int] = frozenset(),
                decode: DecodeRows | None = None) -> PrefillOutput:
        """Computes the sequences' tokens (and, with `decode`, one step of a running batch).

        `all_logits_rows` are the sequences whose every position (not only the last) comes back;
        `hidden_only_rows` of those get the last position's logits alone (vocabulary-wide rows
        for each position cost as much as a few layers). With `decode`, a running batch's next tokens ride in the same forward (TGI's chunking): the
        weights are read once for both, and the running streams advance while the prompt computes.
        """
        query_lens = [s.length for s in seqs]
        embeds = prefill_embeds(self.model, seqs, self.device)
        # prefill rows read the cache in place through the C kernel only (on CUDA: SDPA)
        c_kernel = self.paged_kernel and self.device.type == "cpu"
        positions, meta, logit_rows = _prefill_inputs(seqs, query_lens, all_logits_rows,
                                                      self.spec.block_size, c_kernel, self.device)
        mark_image_spans(self.model, meta, seqs)
        positions = forward_positions(seqs, positions)
        num_decode = None
        if decode is not None:
            num_decode = len(decode.input_ids)
            embeds, positions, logit_rows = self._ride_along(decode, meta, embeds, positions,
                                                             logit_rows)
        with self.adapters.applied(_token_slots(seqs, decode, self.device)):
            hidden = self.model(embeds, positions, self.cache, meta, logit_rows)
        scored = _scored_rows(query_lens, all_logits_rows, hidden_only_rows, num_decode or 0,
                              self.device)
        logits = self.model.logits(hidden if scored is None else hidden[scored])
        return _prefill_output(logits, hidden, query_lens, all_logits_rows, num_decode,
                               hidden_only_rows)

    def _ride_along(self, decode: DecodeRows, meta: AttentionMetadata, embeds: torch.Tensor,
                    positions: torch.Tensor, logit_rows: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A running batch's next tokens put before the prefill's.

        Its rows in the embeddings, positions, metadata (in place) and logit rows."""
        num_decode = len(decode.input_ids)
        part = decode_metadata(decode.seq_lens, decode.block_tables, self.spec, self.paged_kernel)
        embeds = torch.cat([self.model.embed(decode.input_ids), embeds])
        riding = decode.seq_lens if decode.rope_deltas is None else (decode.seq_lens
                                                                      + decode.rope_deltas)
        positions = with_riding_rows(positions, riding)
        meta.slot_blocks = torch.cat([part.slot_blocks, meta.slot_blocks])
        meta.slot_offsets = torch.cat([part.slot_offsets, meta.slot_offsets])
        meta.decode_groups, meta.num_decode_rows = part.decode_groups, num_decode
        meta.decode_tables, meta.decode_context_lens = (part.decode_tables,
                                                         part.decode_context_lens)
        logit_rows = torch.cat([torch.arange(num_decode, device=self.device),
                                logit_rows + num_decode])
        return embeds, positions, logit_rows

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the keys and values of block `source` into block `destination`, per pair.

        A beam about to write into a block it shares does so."""
        if not pairs:
            return
        source = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        destination = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        for layer in self.cache:
            layer.key[destination] = layer.key[source]
            layer.value[destination] = layer.value[source]
            if layer.is_int8:
                layer.key_scale[destination] = layer.key_scale[source]
                layer.value_scale[destination] = layer.value_scale[source]

    @torch.inference_mode()
    def decode(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
               block_tables: torch.Tensor, adapter_slots: torch.Tensor | None = None,
               rope_deltas: torch.Tensor | None = None) -> DecodeOutput:
        """One token per sequence at position seq_lens -> logits [B, vocab] and hidden states.

        Row i with the update of LoRA slot adapter_slots[i] (-1: none), rotated as position
        seq_lens[i] + rope_deltas[i] (multimodal rotary positions, which the compiled step does
        not take: the eager forward runs them instead)."""
        width = self._graph_width(seq_lens, block_tables)
        path = self.decode_path(input_ids.shape[0], width, adapters=adapter_slots is not None)
        positions = None if rope_deltas is None else seq_lens + rope_deltas
        if path is DecodePath.C_STEP:
            out = self.c_step(input_ids, seq_lens, block_tables, row_slots=adapter_slots,
                              positions=positions)
        elif path is DecodePath.CUDA_GRAPHS:
            out = self.graphs(input_ids, seq_lens, block_tables, width, positions)
        elif positions is not None:  # the compiled step rotates by seq_lens
            with self.adapters.applied(adapter_slots):
                out = self._decode_forward(input_ids, seq_lens, block_tables, positions)
        elif path is DecodePath.COMPILED:  # it runs the eager forward itself if it fails
            out = self.decode_step(input_ids, seq_lens, block_tables)
        else:
            with self.adapters.applied(adapter_slots):
                out = self._decode_forward(input_ids, seq_lens, block_tables)
        return DecodeOutput(*out)

    def decode_path(self, rows: int, width: int = 0, *, adapters: bool = False) -> DecodePath:
        """The one place a decode step's path is chosen.

        For `rows` rows whose contexts need `width` block-table columns (_graph_width), some with
        LoRA `adapters`: the C step where allocate built one (only where neither a compiled step
        nor CUDA graphs were asked for; with adapters, where the LoRA kernel built); else, without
        adapters (neither records their updates), a captured graph that holds the step (none
        after a failed capture), or the compiled step while it serves (it turns itself off on a
        failure); else the eager forward."""
        if self.c_step is not None and (not adapters or self.c_step.takes_adapters):
            return DecodePath.C_STEP
        if adapters:
            return DecodePath.EAGER
        if self.graphs is not None and self.graphs.bucket(rows, width) is not None:
            return DecodePath.CUDA_GRAPHS
        if isinstance(self.decode_step, CompiledDecode) and self.decode_step.active:
            return DecodePath.COMPILED
        return DecodePath.EAGER

    def _graph_width(self, seq_lens: torch.Tensor, block_tables: torch.Tensor) -> int:
        """The block-table columns a CUDA graph reads for this step (GraphedDecode.width).

        0 where no graph may take the step."""
        if self.c_step is not None or self.graphs is None or not self.graphs.captured:
            return 0
        return self.graphs.width(seq_lens, block_tables.shape[1])

    def _decode_forward(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, positions: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        meta = decode_metadata(seq_lens, block_tables, self.spec, self.paged_kernel)
        return self._forward_rows(input_ids, seq_lens if positions is None else positions, meta)

    def _forward_rows(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row at `positions` -> (logits, final hidden states).

        The positions are the rows' seq_lens, unless the model rotates them otherwise."""
        hidden = self.model(self.model.embed(input_ids), positions, self.cache, meta)
        return self.model.logits(hidden), hidden

    def _static_decode_forward(self, input_ids: torch.Tensor, seq_lens: torch.Tensor,
                               block_tables: torch.Tensor, positions: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode forward a CUDA graph records (see static_decode_metadata)."""
        return self._forward_rows(input_ids, positions,
                                  static_decode_metadata(
                                      seq_lens, block_tables, self.spec,
                                      in_place=self.attention_kernel == decode_backend.TRITON))


def _token_slots(seqs: list[PrefillSequence], decode: DecodeRows | None,
                 device: torch.device) -> torch.Tensor | None:
    """The LoRA slot of every row of a prefill forward (a riding batch's rows first).

    None when no row has an adapter."""
    riding = decode.adapter_slots if decode is not None else None
    if riding is None and all(s.adapter_slot < 0 for s in seqs):
        return None
    parts = [] if decode is None else [
        riding if riding is not None
        else torch.full((len(decode.input_ids),), -1, dtype=torch.long, device=device)]
    parts += [torch.full((s.length,), s.adapter_slot, dtype=torch.long, device=device)
              for s in seqs]
    return torch.cat(parts)


def _prefill_inputs(seqs: list[PrefillSequence], query_lens: list[int], all_logits_rows: set[int],
                    block_size: int, paged_kernel: bool, device: torch.device
                    ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """A prefill's positions, attention metadata and the rows whose logits come back.

    The rows are every position of the sequences in all_logits_rows, the last of the others."""
    context_lens = [s.start + n for s, n in zip(seqs, query_lens)]
    positions = torch.cat([torch.arange(s.start, c, dtype=torch.long, device=device)
                           for s, c in zip(seqs, context_lens)])
    num_blocks = -(-max(context_lens) // block_size)
    block_tables = pad_blocks([s.blocks[:num_blocks] for s in seqs], device)
    meta = prefill_metadata(block_tables, positions, query_lens, context_lens, block_size)
    if paged_kernel:
        route_short_contexts(meta, block_tables, positions, query_lens, context_lens)
    ends = torch.tensor(query_lens, device=device).cumsum(0)
    starts = ends - torch.tensor(query_lens, device=device)
    rows = []
    for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        rows.extend(range(start, end) if i in all_logits_rows else [end - 1])
    return positions, meta, torch.tensor(rows, dtype=torch.long, device=device)


def _scored_rows(query_lens: list[int], all_logits_rows: set[int], hidden_only_rows: set[int],
                 num_decode: int, device: torch.device) -> torch.Tensor | None:
    """The rows of the forward's output whose logits are computed; None: all of them."""
    if not hidden_only_rows & all_logits_rows:
        return None
    rows, cursor = list(range(num_decode)), num_decode
    for i, n in enumerate(query_lens):
        width = n if i in all_logits_rows else 1
        rows.extend(range(cursor + width - 1 if i in hidden_only_rows else cursor, cursor + width))
        cursor += width
    return torch.tensor(rows, dtype=torch.long, device=device)


def _prefill_output(logits: torch.Tensor, hidden: torch.Tensor, query_lens: list[int],
                    all_logits_rows: set[int], num_decode: int | None,
                    hidden_only_rows: set[int] = frozenset()) -> PrefillOutput:
    """The forward's rows (a riding batch's first, then the prefill's) split per sequence.

    `logits` holds the rows _scored_rows chose: a hidden-only sequence's last row alone."""
    out = PrefillOutput(logits[0:0], [], [])
    if num_decode is not None:
        out.decode, out.decode_hidden = logits[:num_decode], hidden[:num_decode]
    last, cursor, scored = [], num_decode or 0, num_decode or 0
    for i, n in enumerate(query_lens):
        every = i in all_logits_rows
        width = n if every else 1
        scored_width = 1 if i in hidden_only_rows else width
        chunk = logits[scored:scored + scored_width]
        last.append(chunk[-1])
        out.full.append(chunk if every and i not in hidden_only_rows else None)
        out.hidden.append(hidden[cursor:cursor + width] if every else None)
        cursor += width
        scored += scored_width
    out.last = torch.stack(last)
    return out
