"""The rows a decode step computes, and whether the next plain step may start before this one is read.

A plain batch's rows are its requests; with beam search, one row per beam. On CUDA the next step's
forward can be queued right after this step's sampling (its input tokens are already on the
device), so that the host's work on this step (detokenising, stop criteria, the reply) overlaps
the device's work on the next one, as SGLang's overlap scheduler and vLLM's asynchronous
scheduling do.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shard.batch_state import Batch, block_table_tensor
from shard.model_runner import DecodeOutput, DecodeRows, ModelRunner


@dataclass(slots=True)
class QueuedStep:
    """A plain decode step's forward, queued before the step before it was read.

    It outlives the call that queued it: the router then asks for the batch's next step (after
    filtering out finished requests, whose rows are dropped), or has a prefill carry the batch,
    which takes this step as the batch's instead of computing its rows again."""

    batch_id: int
    request_ids: list[int]  # the batch's requests, in the order of the forward's rows
    out: DecodeOutput
    forward_ns: int = 0  # the time its forward took to queue (the step that takes it reports it)

    def serves(self, batch: Batch) -> bool:
        """Whether this is `batch`'s next step: the same batch, holding the same requests."""
        return batch.id == self.batch_id and batch.request_ids == self.request_ids

    def kept(self, request_ids: list[int]) -> QueuedStep | None:
        """This step for its batch filtered to `request_ids` (None for an id it did not compute)."""
        position = {rid: i for i, rid in enumerate(self.request_ids)}
        if any(rid not in position for rid in request_ids):
            return None
        index = torch.tensor([position[rid] for rid in request_ids], dtype=torch.long,
                             device=self.out.logits.device)
        return QueuedStep(self.batch_id, list(request_ids),
                          DecodeOutput(self.out.logits.index_select(0, index),
                                       self.out.hidden.index_select(0, index)), self.forward_ns)


def taken(queued: QueuedStep | None, batch: Batch) -> QueuedStep | None:
    """`queued` where it is `batch`'s next step, else None (it is dropped, computed for nothing)."""
    return queued if queued is not None and queued.serves(batch) else None


def queue_next(batch: Batch, runner: ModelRunner, one_rank: bool) -> QueuedStep | None:
    """The forward of `batch`'s next plain step, queued now (its tokens are drawn, not read).

    On a shard of one rank, None where the device ran out of memory for it: the step computes it
    again when it comes, and fails there if it must, as itself and not as the step before. With
    several ranks any failure is raised: a rank that dropped its step while the others kept
    theirs would pair its all-reduces with the wrong ones."""
    rows = plain_rows(batch)
    started = time.perf_counter_ns()
    try:
        out = runner.decode(rows.input_ids, rows.seq_lens, rows.block_tables, rows.adapter_slots,
                            rows.rope_deltas)
    except torch.OutOfMemoryError:
        if not one_rank:
            raise
        return None
    return QueuedStep(batch.id, batch.request_ids, out, time.perf_counter_ns() - started)


def decode_rows(batch: Batch, runner: ModelRunner) -> tuple[DecodeRows, list[int] | None]:
    """The rows a decode step of `batch` computes, and None when they are its requests.

    With beam-search requests, one row per beam, and for each request the index of its first
    row. A beam about to write into a block it shares gets its own copy first."""
    if not any(state.beams is not None for state in batch.requests):
        return plain_rows(batch), None
    ids, lengths = batch.next_input_ids.tolist(), batch.seq_lens.tolist()
    tables = batch.block_tables.tolist()
    rows_ids, rows_lengths, rows_tables, first, copies = [], [], [], [], []
    for row, state in enumerate(batch.requests):
        first.append(len(rows_ids))
        if state.beams is None:
            rows_ids.append(ids[row])
            rows_lengths.append(lengths[row])
            rows_tables.append(tables[row])
            continue
        copies += state.beams.blocks.prepare_writes(lengths[row])
        for token, table in zip(state.beams.search.next_tokens(), state.beams.blocks.tables):
            rows_ids.append(token)
            rows_lengths.append(lengths[row])
            rows_tables.append(table)
    runner.copy_blocks(copies)
    device = runner.device
    rows_per_request = [end - start for start, end in zip(first, first[1:] + [len(rows_ids)])]
    return DecodeRows(torch.tensor(rows_ids, dtype=torch.long, device=device),
                      torch.tensor(rows_lengths, dtype=torch.long, device=device),
                      block_table_tensor(rows_tables, device),
                      batch.adapter_slots(rows_per_request),
                      batch.rope_deltas(rows_per_request)), first


def plain_rows(batch: Batch) -> DecodeRows:
    """A batch without beams: a row per request, its last token at its length."""
    return DecodeRows(batch.next_input_ids, batch.seq_lens, batch.block_tables,
                      batch.adapter_slots(), batch.rope_deltas())


def may_run_ahead(batch: Batch) -> bool:
    """Whether the step after the one being sampled may start before its tokens are read.

    Not with beams (their next rows depend on the search) and not when a request takes its last
    token now: the step after would write that token's keys and values one slot past what the
    router gave it (it gives input + max_new_tokens - 1). A request that stops on its own (an
    end token, a stop sequence) has its row of that step computed for nothing, in a slot of its
    own."""
    for state in batch.requests:
        if state.beams is not None or state.stop.num_generated + 1 >= state.stop.max_new_tokens:
            return False
    return True
