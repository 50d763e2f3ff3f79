"""A speculative decode step: each request's n-gram drafts verified in one forward.

The drafts come from shard.speculation; each request's tokens are chosen position by position as
plain steps would have chosen them."""
from __future__ import annotations

import torch

from shard.batch_state import Batch, sample_batch
from shard.generations import Vocabulary, step_generations
from shard.model_runner import DecodeRows
from shard.outputs import RequestOutput, extend
from shard.speculation import acceptance_threshold


def drafts(batch: Batch, speculate: int) -> list[list[int]] | None:
    """Each request's draft tokens for this step (maybe none), or None for a plain step.

    None when speculation is off, or a beam search is in the batch."""
    if not speculate or any(s.beams is not None for s in batch.requests):
        return None
    threshold = acceptance_threshold(len(batch.requests))
    drafted = []
    for state in batch.requests:
        # every token a draft leads to must fit the request's budget: its keys and values
        # then stay within the blocks the router reserved for it
        room = min(speculate, state.stop.max_new_tokens - state.stop.num_generated - 1)
        if room > 0:
            drafted.append(state.drafter.drafts(state.all_ids, room, threshold))
        else:
            state.drafter.shadow = None  # no guess this step, none to check
            drafted.append([])
    return drafted


def verify_rows(batch: Batch, drafted: list[list[int]], device: torch.device) -> DecodeRows:
    """The forward's rows to verify drafts: one per token to verify.

    A request's next input, then each draft token at the position after it, each reading the
    request's blocks up to its own position."""
    ids, lengths = batch.next_input_ids.tolist(), batch.seq_lens.tolist()
    rows_ids, rows_lengths, owners = [], [], []
    for row, draft in enumerate(drafted):
        rows_ids += [ids[row], *draft]
        rows_lengths += range(lengths[row], lengths[row] + 1 + len(draft))
        owners += [row] * (1 + len(draft))
    owners = torch.tensor(owners, dtype=torch.long, device=device)
    return DecodeRows(torch.tensor(rows_ids, dtype=torch.long, device=device),
                      torch.tensor(rows_lengths, dtype=torch.long, device=device),
                      batch.block_tables.index_select(0, owners),
                      batch.adapter_slots([1 + len(draft) for draft in drafted]),
                      batch.rope_deltas([1 + len(draft) for draft in drafted]))


def accept(batch: Batch, drafted: list[list[int]], logits: torch.Tensor, hidden: torch.Tensor,
           vocab: Vocabulary) -> list[RequestOutput]:
    """The tokens chosen position by position over verified drafts, as plain steps would have.

    At each position the requests still in the run sample from its logits (penalties, grammar,
    seeded draws and stopping see exactly the tokens before it), and a request goes on to its next
    position only while its chosen token is the draft token that position was computed from."""
    first, offset = [], 0
    for draft in drafted:
        first.append(offset)
        offset += 1 + len(draft)
    merged: dict[int, RequestOutput] = {}
    emitted = [0] * len(drafted)
    last = [0] * len(drafted)
    pending, position = list(range(len(drafted))), 0
    while pending:
        index = [first[row] + position for row in pending]
        part = batch if len(pending) == len(drafted) else _rows_of(batch, pending)
        # where this position's token goes: a plain step would have drawn it there too
        at = batch.seq_lens.index_select(0, torch.tensor(pending, device=logits.device))
        output = sample_batch(logits[torch.tensor(index, device=logits.device)], part,
                              positions=at + (1 + position))
        generations = step_generations(part, output, [hidden[i:i + 1] for i in index], logits,
                                       vocab)
        chosen = output.next_ids.tolist()
        still = []
        for k, row in enumerate(pending):
            emitted[row] += 1
            last[row] = chosen[k]
            if row in merged:
                extend(merged[row], generations[k])
            else:
                merged[row] = generations[k]
            draft = drafted[row]
            if (batch.requests[row].finish_reason is None and position < len(draft)
                    and chosen[k] == draft[position]):
                still.append(row)
        pending, position = still, position + 1
    device = batch.seq_lens.device
    batch.seq_lens = batch.seq_lens + torch.tensor(emitted, dtype=torch.long, device=device)
    batch.next_input_ids = torch.tensor(last, dtype=torch.long, device=device)
    return [merged[row] for row in range(len(drafted))]


def observe(batch: Batch, drafted: list[list[int]], generations: list[RequestOutput]) -> int:
    """Each request's record of guesses (sent or only checked); the draft tokens accepted."""
    accepted = 0
    for state, draft, generation in zip(batch.requests, drafted, generations):
        accepted += state.drafter.observe(draft, generation.tokens.ids)
    return accepted


def _rows_of(batch: Batch, rows: list[int]) -> Batch:
    """The listed rows' requests and sampling state, for choosing their tokens alone.

    The tensors a forward reads are left out: the step already ran."""
    return Batch(id=batch.id, requests=[batch.requests[r] for r in rows],
                 block_tables=batch.block_tables, seq_lens=batch.seq_lens,
                 next_input_ids=batch.next_input_ids, sampling=batch.sampling.select(rows))
