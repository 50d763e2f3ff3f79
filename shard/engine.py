"""The shard's batches and the step pipeline: inputs -> model -> sample -> stop -> detokenise -> Generations.

The engine owns the cache of batches (id -> Batch) and the KV pool through the model runner; every
method takes and returns plain dataclasses, so the gRPC servicer stays a thin converter.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from shard.batch_state import (Batch, NewRequest, RequestState, block_table_tensor, concatenate_batches,
                         filter_batch)
from shard.beams import BeamBlocks, BeamOptions, Beams, BeamSearch
from shard.detokenizer import DetokenizerState, decode_next, flush
from shard.grammar_matcher import GrammarFactory, advance
from shard.loader import LoadedModel
from shard.kv_budget import PoolLedger, kv_budget_bytes
from shard.model_runner import DecodeRows, ModelRunner, PrefillSequence
from shard.outputs import (CachedBatch, GeneratedText, Generation, PromptScores, StepResult,
                           TokenRun, WarmupResult)
from shard.sampling import SampleOutput, SamplingBatch, needs_history, sample
from shard.speculation import Drafter, acceptance_threshold
from shard.stopping import FinishReason, StopCriteria

log = logging.getLogger("tgi.shard.engine")


class BatchNotFound(KeyError):
    pass


class Engine:
    def __init__(self, loaded: LoadedModel, runner: ModelRunner, *, memory_fraction: float = 1.0,
                 world_size: int = 1, speculate: int = 0, ledger: PoolLedger | None = None):
        self.loaded = loaded
        self.speculate = speculate  # draft tokens per request and step (0: no speculation)
        self.world_size = world_size
        self.grammars = GrammarFactory(loaded.tokenizer.to_str(), loaded.config.vocab_size,
                                       sorted(loaded.eos_token_ids))
        self.tokenizer = loaded.tokenizer
        self.vocab_size = loaded.config.vocab_size
        self.hidden_size = loaded.config.hidden_size
        self.max_positions = loaded.config.max_position_embeddings
        self.runner = runner
        self.block_size = runner.spec.block_size
        self.memory_fraction = memory_fraction
        self.ledger = ledger if runner.device.type == "cpu" else None  # CUDA pools are allocated
        self.batches: dict[int, Batch] = {}

    # ---- public API -------------------------------------------------------------------------

    def warmup(self, requests: list[NewRequest], max_batch_total_tokens: int,
               max_total_tokens: int = 0) -> WarmupResult:
        """Runs the largest prefill once, then sizes the KV pool (tokens asked, or a memory
        budget) and prepares the decode step for requests of up to max_total_tokens (compiled or
        captured, where it is to be)."""
        block_size = self.block_size
        next_block = 1
        for request in requests:
            count = math.ceil((request.prompt_length + 1) / block_size)
            request.blocks = list(range(next_block, next_block + count))
            next_block += count
        self.runner.allocate(next_block)
        self.clear()
        if requests:
            self._prefill_step(requests)
        self.clear()
        if max_batch_total_tokens:
            num_blocks = math.ceil(max_batch_total_tokens / block_size) + 1
        else:
            self.runner.allocate(1)
            others = self.ledger.held_by_others() if self.ledger is not None else 0
            budget = kv_budget_bytes(self.runner.device, self.memory_fraction, self.world_size,
                                     held_by_others=others)
            num_blocks = budget // self.runner.spec.bytes_per_block
        if num_blocks < 2:
            raise RuntimeError("not enough memory for a single KV block; lower the dtype or "
                               "the model size, raise --cuda-memory-fraction, or fix the pool's "
                               "size with --max-batch-total-tokens")
        self.runner.allocate(num_blocks)
        if self.ledger is not None:
            self.ledger.record(num_blocks * self.runner.spec.bytes_per_block)
        self.runner.warm_decode(max_total_tokens)
        return WarmupResult(num_blocks=num_blocks, block_size=block_size)

    def prefill(self, batch_id: int, requests: list[NewRequest],
                cached_batch_id: int | None = None) -> StepResult:
        """Computes new prompts (or one chunk of a long one); with `cached_batch_id`, that running
        batch also takes its next step in the same forward and the new requests join it."""
        start = time.perf_counter_ns()
        is_chunk = any(r.is_partial_chunk for r in requests)
        if is_chunk and len(requests) != 1:
            raise ValueError("a chunk that stops short of its prompt's end must be prefilled alone")
        if cached_batch_id is not None and cached_batch_id not in self.batches:
            raise BatchNotFound(cached_batch_id)
        requests, rejected = self._admit(requests)
        if not requests:  # nothing new to compute: the riding batch takes a plain step
            result = (self.decode([cached_batch_id]) if cached_batch_id is not None
                      else StepResult([], None))
            result.rejected = rejected
            return result
        running = self._pop(cached_batch_id) if cached_batch_id is not None else None
        batch, generations, forward_ns = self._prefill_step(requests, batch_id, running)
        if batch is None:
            return StepResult([], None, forward_ns=forward_ns, decode_ns=0,
                              total_ns=time.perf_counter_ns() - start, rejected=rejected)
        result = self._finish_step(batch, generations, start, forward_ns)
        result.rejected = rejected
        return result

    def _admit(self, requests: list[NewRequest]
               ) -> tuple[list[NewRequest], list[tuple[int, str]]]:
        """The requests this shard can compute, and (id, why) of each it refuses: one request's
        bad data (a grammar this vocabulary cannot follow, blocks it does not hold) must not fail
        the others, nor a running batch riding in the same forward."""
        pool = self.runner.num_blocks
        kept, rejected = [], []
        for request in requests:
            try:
                needed = request.prompt_length + request.max_new_tokens - 1
                if needed > self.max_positions:  # the rotary table ends there (on CUDA an
                    # index past it is a device-side assert, which ends the process)
                    raise ValueError(f"request {request.id} reaches position {needed - 1}, past "
                                     f"the model's {self.max_positions} positions")
                if needed > len(request.blocks) * self.block_size:
                    raise ValueError(f"request {request.id} needs {needed} KV slots but holds "
                                     f"{len(request.blocks)} blocks of {self.block_size}")
                # the decode kernel reads blocks through raw pointers: a stray id must stop here
                if request.blocks and not 0 <= min(request.blocks) <= max(request.blocks) < pool:
                    raise ValueError(f"request {request.id} names a KV block outside the pool of "
                                     f"{pool} blocks")
                # an id past the embedding table is an IndexError on CPU, a device assert on CUDA
                if request.input_ids and not 0 <= min(request.input_ids) <= max(
                        request.input_ids) < self.vocab_size:
                    raise ValueError(f"request {request.id} has token ids outside the model's "
                                     f"vocabulary of {self.vocab_size}")
                if max(request.params.top_n_tokens, request.prefill_top_n_tokens) > self.vocab_size:
                    raise ValueError(f"request {request.id} asks for more top tokens than the "
                                     f"vocabulary of {self.vocab_size} holds")
                if request.params.logit_bias and max(request.params.logit_bias) >= self.vocab_size:
                    raise ValueError(f"request {request.id} biases a token id outside the "
                                     f"vocabulary of {self.vocab_size}")
                if request.logprob_token_ids and max(request.logprob_token_ids) >= self.vocab_size:
                    raise ValueError(f"request {request.id} asks for the log-probability of a "
                                     f"token id outside the vocabulary of {self.vocab_size}")
                self._check_embeds(request)
                self._check_beams(request)
                if not request.is_partial_chunk:  # the last chunk compiles it
                    request.matcher = self._matcher(request)
            except ValueError as err:
                rejected.append((request.id, str(err)))
                continue
            kept.append(request)
        return kept, rejected

    def _check_embeds(self, request: NewRequest) -> None:
        embeds = request.input_embeds
        if embeds is None:
            return
        if request.input_ids:
            raise ValueError(f"request {request.id} gives both token ids and input embeddings")
        if embeds.dim() != 2 or embeds.shape[1] != self.hidden_size:
            raise ValueError(f"request {request.id}: input embeddings must be rows of "
                             f"{self.hidden_size} values (the model's hidden size)")
        # in the model's dtype, as computed: float16 turns values past 65504 into infinities
        if not torch.isfinite(embeds.to(self.runner.model.activation_dtype)).all():
            raise ValueError(f"request {request.id}: input embeddings must be finite in "
                             f"{str(self.runner.model.activation_dtype).removeprefix('torch.')}")
        if request.prefill_logprobs:
            raise ValueError(f"request {request.id}: a prompt given as embeddings has no token "
                             "ids to score")

    def _check_beams(self, request: NewRequest) -> None:
        if request.num_beams <= 1:
            return
        params = request.params
        if (request.grammar or request.stop_sequences or request.min_new_tokens
                or request.prefill_logprobs or request.return_hidden_states
                or request.logprob_token_ids or params.has_penalty or params.watermark
                or request.ignore_eos or request.input_embeds is not None):
            raise ValueError(f"request {request.id}: beam search takes no grammar, stop "
                             "sequences, min_new_tokens, penalties, watermark, ignore_eos, "
                             "prompt scores, hidden states or input embeddings")
        # every beam may hold a whole sequence, and the prompt's partial block stays aside
        per_beam = math.ceil((request.prompt_length + request.max_new_tokens - 1) / self.block_size)
        needed = request.num_beams * per_beam + 1
        if len(request.blocks) < needed:
            raise ValueError(f"request {request.id}: {request.num_beams} beams need {needed} KV "
                             f"blocks, it holds {len(request.blocks)}")

    def decode(self, batch_ids: list[int], max_steps: int = 1,
               on_step: Callable[[StepResult], None] | None = None) -> StepResult:
        """Up to `max_steps` decode steps of the batches (merged), back to back: one call's
        round trip for several tokens when nothing else is due. It stops after a step in which a
        request finished (the router drops it before the next), and takes one step when
        speculating or when the batch holds a beam-search request (their steps are not plain
        ones). Each step's tokens are added to their requests' Generations, as speculation's
        accepted tokens are; with `on_step`, every step but the last is handed to it instead as
        it ends (to be streamed), and the result holds the last step's Generations with the
        whole call's steps and times."""
        result = self._decode_step(batch_ids)
        while result.steps < max_steps and self._may_step_again(result):
            if on_step is None:
                result = _merge_steps(result, self._decode_step([result.batch.id]))
            else:
                on_step(result)  # before the next step: its tokens go out while it computes
                result = _after_steps(result, self._decode_step([result.batch.id]))
        return result

    def _may_step_again(self, result: StepResult) -> bool:
        if result.batch is None or self.speculate:
            return False
        if any(g.generated_text is not None for g in result.generations):
            return False
        return not any(s.beams is not None for s in self.batches[result.batch.id].requests)

    def _decode_step(self, batch_ids: list[int]) -> StepResult:
        start = time.perf_counter_ns()
        batches = [self._pop(i) for i in batch_ids]
        concat_ns = None
        if len(batches) > 1:
            before = time.perf_counter_ns()
            batch = concatenate_batches(batches)
            concat_ns = time.perf_counter_ns() - before
        else:
            batch = batches[0]
        drafts = self._drafts(batch)
        verifies = drafts is not None and any(drafts)
        before = time.perf_counter_ns()
        if verifies:
            rows = self._verify_rows(batch, drafts)
            out = self.runner.decode(rows.input_ids, rows.seq_lens, rows.block_tables)
            forward_ns = time.perf_counter_ns() - before
            generations = self._accept(batch, drafts, out.logits, out.hidden)
        else:  # nothing to verify: a plain step, at a plain step's cost
            rows, first = self._decode_rows(batch)
            out = self.runner.decode(rows.input_ids, rows.seq_lens, rows.block_tables)
            forward_ns = time.perf_counter_ns() - before
            generations = self._step_rows(batch, out.logits, out.hidden, first)
        accepted = 0
        if drafts is not None:  # each request's record of guesses (sent or only checked)
            for state, draft, generation in zip(batch.requests, drafts, generations):
                accepted += state.drafter.observe(draft, generation.tokens.ids)
        result = self._finish_step(batch, generations, start, forward_ns)
        result.concat_ns = concat_ns
        if verifies:
            result.draft_tokens = sum(len(d) for d in drafts)
            result.accepted_tokens = accepted
        return result

    def filter(self, batch_id: int, request_ids: list[int]) -> CachedBatch:
        if not request_ids:
            raise ValueError("FilterBatch needs at least one request id; use ClearCache to drop a batch")
        batch = filter_batch(self._pop(batch_id), request_ids)
        self.batches[batch.id] = batch
        return self._info(batch)

    def clear(self, batch_id: int | None = None) -> None:
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)

    # ---- steps ------------------------------------------------------------------------------

    def _prefill_step(self, requests: list[NewRequest], batch_id: int = 0,
                      running: Batch | None = None):
        """-> (the batch to keep: the new requests, the running one, or both merged under the
        running one's id; None when a partial chunk ran alone), generations, forward time."""
        is_chunk = any(r.is_partial_chunk for r in requests)
        seqs = [_sequence(r) for r in requests]
        # a partial chunk computes keys and values only: its token comes with the last chunk
        logits_rows = set() if is_chunk else {i for i, r in enumerate(requests)
                                              if r.computes_every_position}
        decode, first = None, None
        if running is not None:
            decode, first = self._decode_rows(running)
        before = time.perf_counter_ns()
        out = self.runner.prefill(seqs, all_logits_rows=logits_rows, decode=decode)
        forward_ns = time.perf_counter_ns() - before
        batches, generations = [], []
        if running is not None:
            generations += self._step_rows(running, out.decode, out.decode_hidden, first)
            batches.append(running)
        if not is_chunk:
            batch = self._new_batch(batch_id, requests)
            output = sample(out.last, batch.sampling, self._penalty_ids(batch),
                            _banned(batch.requests))
            batch.next_input_ids = output.next_ids
            new_generations = self._generations(batch, output, out.hidden, out.last)
            for i, request in enumerate(requests):
                if request.prefill_logprobs and new_generations[i] is not None:
                    new_generations[i].prompt = self._prompt_scores(request, out.full[i])
            generations += [g for g in new_generations if g is not None]
            batches.append(batch)
        if not batches:
            return None, generations, forward_ns
        return (batches[0] if len(batches) == 1 else concatenate_batches(batches),
                generations, forward_ns)

    def _new_batch(self, batch_id: int, requests: list[NewRequest]) -> Batch:
        device = self.runner.device
        return Batch(
            id=batch_id, requests=[self._state(r) for r in requests],
            block_tables=block_table_tensor([r.blocks for r in requests], device),
            seq_lens=torch.tensor([r.prompt_length for r in requests], dtype=torch.long,
                                  device=device),
            next_input_ids=torch.zeros(len(requests), dtype=torch.long, device=device),
            sampling=SamplingBatch.from_params(
                [r.params for r in requests], device,
                grammars=[r.matcher for r in requests]),
        )

    def _finish_step(self, batch: Batch, generations: list[Generation], start: int,
                     forward_ns: int) -> StepResult:
        decode_ns = time.perf_counter_ns() - start - forward_ns
        info = None
        if any(r.finish_reason is None for r in batch.requests):
            self.batches[batch.id] = batch
            info = self._info(batch)
        return StepResult(generations, info, forward_ns=forward_ns, decode_ns=decode_ns,
                          total_ns=time.perf_counter_ns() - start)

    def _decode_rows(self, batch: Batch) -> tuple[DecodeRows, list[int] | None]:
        """The rows a decode step of `batch` computes, and None; with beam-search requests, one
        row per beam, and for each request the index of its first row. A beam about to write into
        a block it shares gets its own copy first."""
        if not any(state.beams is not None for state in batch.requests):
            return DecodeRows(batch.next_input_ids, batch.seq_lens, batch.block_tables), None
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
        self.runner.copy_blocks(copies)
        device = self.runner.device
        return DecodeRows(torch.tensor(rows_ids, dtype=torch.long, device=device),
                          torch.tensor(rows_lengths, dtype=torch.long, device=device),
                          block_table_tensor(rows_tables, device)), first

    # ---- speculative steps -------------------------------------------------------------------

    def _drafts(self, batch: Batch) -> list[list[int]] | None:
        """Each request's draft tokens for this step (maybe none), or None for a plain step
        (speculation off, or a beam search in the batch)."""
        if not self.speculate or any(s.beams is not None for s in batch.requests):
            return None
        threshold = acceptance_threshold(len(batch.requests))
        drafts = []
        for state in batch.requests:
            # every token a draft leads to must fit the request's budget: its keys and values
            # then stay within the blocks the router reserved for it
            room = min(self.speculate, state.stop.max_new_tokens - state.stop.num_generated - 1)
            if room > 0:
                drafts.append(state.drafter.drafts(state.all_ids, room, threshold))
            else:
                state.drafter.shadow = None  # no guess this step, none to check
                drafts.append([])
        return drafts

    def _verify_rows(self, batch: Batch, drafts: list[list[int]]) -> DecodeRows:
        """One row per token to verify: a request's next input, then each draft token at the
        position after it, each reading the request's blocks up to its own position."""
        ids, lengths = batch.next_input_ids.tolist(), batch.seq_lens.tolist()
        rows_ids, rows_lengths, owners = [], [], []
        for row, draft in enumerate(drafts):
            rows_ids += [ids[row], *draft]
            rows_lengths += range(lengths[row], lengths[row] + 1 + len(draft))
            owners += [row] * (1 + len(draft))
        device = self.runner.device
        owners = torch.tensor(owners, dtype=torch.long, device=device)
        return DecodeRows(torch.tensor(rows_ids, dtype=torch.long, device=device),
                          torch.tensor(rows_lengths, dtype=torch.long, device=device),
                          batch.block_tables.index_select(0, owners))

    def _accept(self, batch: Batch, drafts: list[list[int]], logits: torch.Tensor,
                hidden: torch.Tensor) -> list[Generation]:
        """Chooses tokens position by position, as plain steps would have: at each position the
        requests still in the run sample from its logits (penalties, grammar, seeded draws and
        stopping see exactly the tokens before it), and a request goes on to its next position
        only while its chosen token is the draft token that position was computed from."""
        first, offset = [], 0
        for draft in drafts:
            first.append(offset)
            offset += 1 + len(draft)
        merged: dict[int, Generation] = {}
        emitted = [0] * len(drafts)
        last = [0] * len(drafts)
        pending, position = list(range(len(drafts))), 0
        while pending:
            index = [first[row] + position for row in pending]
            part = batch if len(pending) == len(drafts) else _rows_of(batch, pending)
            output = sample(logits[torch.tensor(index, device=logits.device)], part.sampling,
                            self._penalty_ids(part), _banned(part.requests))
            generations = self._generations(part, output,
                                            [hidden[i:i + 1] for i in index], logits)
            chosen = output.next_ids.tolist()
            still = []
            for k, row in enumerate(pending):
                emitted[row] += 1
                last[row] = chosen[k]
                generation = generations[k]
                if row in merged:
                    _extend(merged[row], generation)
                else:
                    merged[row] = generation
                draft = drafts[row]
                if (batch.requests[row].finish_reason is None and position < len(draft)
                        and chosen[k] == draft[position]):
                    still.append(row)
            pending, position = still, position + 1
        device = batch.seq_lens.device
        batch.seq_lens = batch.seq_lens + torch.tensor(emitted, dtype=torch.long, device=device)
        batch.next_input_ids = torch.tensor(last, dtype=torch.long, device=device)
        return [merged[row] for row in range(len(drafts))]

    def _step_rows(self, batch: Batch, logits: torch.Tensor, hidden: torch.Tensor,
                   first: list[int] | None) -> list[Generation]:
        """The decode step's outputs (rows from _decode_rows) -> each request's generation."""
        batch.seq_lens = batch.seq_lens + 1
        row_logits, row_hidden = logits, hidden
        if first is not None:  # one row per request for sampling; beams read all of theirs
            index = torch.tensor(first, dtype=torch.long, device=logits.device)
            row_logits, row_hidden = logits[index], hidden[index]
        output = sample(row_logits, batch.sampling, self._penalty_ids(batch),
                        _banned(batch.requests))
        batch.next_input_ids = output.next_ids
        generations = self._generations(batch, output, [row_hidden[row:row + 1] for row in
                                                        range(len(batch.requests))],
                                        logits, first)
        return [g for g in generations if g is not None]

    def _generations(self, batch: Batch, output: SampleOutput, hidden: list[torch.Tensor | None],
                     logits: torch.Tensor, first: list[int] | None = None
                     ) -> list[Generation | None]:
        """Appends each row's token, detokenises it, checks stopping (a Python loop by nature).
        `hidden` holds, per row, the final hidden states this step computed for it; `logits` and
        `first` are the step's rows (see _decode_rows), which a beam-search request reads all of
        (its generation is None until its search ends)."""
        ids = output.next_ids.tolist()
        if batch.sampling.flags["grammar"]:
            advance(batch.sampling.grammars, ids)
        logprobs = output.logprobs.tolist()
        top_ids = output.top_ids.tolist() if output.top_ids is not None else None
        top_lps = output.top_logprobs.tolist() if output.top_logprobs is not None else None
        special = self.loaded.special_token_ids
        generations = []
        for row, state in enumerate(batch.requests):
            if state.beams is not None:
                start = row if first is None else first[row]
                generations.append(self._beam_step(
                    state, logits[start:start + state.beams.search.width]))
                continue
            token = ids[row]
            state.all_ids.append(token)
            text = decode_next(self.tokenizer, state.all_ids, state.detok, state.skip_special_tokens)
            reason = state.stop.check(token, text)
            broken = _grammar_error(batch.sampling.grammars[row])
            if broken is not None and reason is None:
                reason = FinishReason.EOS_TOKEN  # it ends here; the router hears `broken`
            generated = None
            if reason is FinishReason.STOP_SEQUENCE:
                # TGI keeps the stop sequence in the output, and nothing after it
                text = text[:len(text) - state.stop.excess_chars]
            elif reason is not None:
                text += flush(self.tokenizer, state.all_ids, state.detok, state.skip_special_tokens)
            if reason is not None:
                state.finish_reason = reason
            state.text.append(text)
            if reason is not None:
                params = batch.sampling.params[row]
                generated = GeneratedText("".join(state.text), state.stop.num_generated, reason,
                                          params.seed if params.do_sample else None)
            tokens = TokenRun([token], [logprobs[row]], [text], [token in special])
            top = []
            n = batch.sampling.params[row].top_n_tokens
            if n and top_ids is not None:
                alt = top_ids[row][:n]
                top = [TokenRun(alt, top_lps[row][:n], [self.tokenizer.decode([t]) for t in alt],
                                [t in special for t in alt])]
            generation = Generation(state.id, tokens, generated_text=generated, top_tokens=top,
                                    error=broken)
            if state.logprob_token_ids:
                generation.token_ids_logprobs = _logprobs_of(output.log_distribution()[row],
                                                             state.logprob_token_ids)
            if state.return_hidden_states:
                generation.hidden_states = hidden[row].float().cpu()
            generations.append(generation)
        return generations

    def _beam_step(self, state: RequestState, logits: torch.Tensor) -> Generation | None:
        """One step of a beam search; its generation once the search is over: the best
        hypothesis, its text decoded as a stream of it would have been."""
        beams = state.beams
        try:
            parents = beams.search.step(torch.log_softmax(logits.float(), dim=-1))
            beams.blocks.reorder(parents)
        except Exception:  # this request's search ends with what it has; the batch goes on
            log.exception("beam search of request %d failed; it ends here", state.id)
            beams.search.done = True
        if not beams.search.done:
            return None
        best = beams.search.best().token_ids
        if not best:  # the search failed at its first step: the first beam's likeliest token
            best = [int(logits[0].argmax())]
        text = []
        for token in best:
            state.all_ids.append(token)
            text.append(decode_next(self.tokenizer, state.all_ids, state.detok,
                                    state.skip_special_tokens))
        text.append(flush(self.tokenizer, state.all_ids, state.detok, state.skip_special_tokens))
        text = "".join(text)
        reason = (FinishReason.EOS_TOKEN if best[-1] in self.loaded.eos_token_ids
                  else FinishReason.LENGTH)
        state.finish_reason = reason
        generator = beams.search.generator
        generated = GeneratedText(text, len(best), reason,
                                  generator.initial_seed() if generator is not None else None,
                                  token_ids=best)
        last = best[-1]
        # one run for the whole answer: all of its text arrives with this step
        return Generation(state.id, TokenRun([last], [math.nan], [text],
                                             [last in self.loaded.special_token_ids]),
                          generated_text=generated)

    def _prompt_scores(self, request: NewRequest, logits: torch.Tensor) -> PromptScores:
        """Prompt tokens with log p(token | earlier tokens), and the top tokens and the asked ids'
        log-probabilities at each position; the first position has none (NaN, empty)."""
        ids = request.input_ids
        computed = ids[request.cache_len:]
        skipped = len(ids) - len(computed) + 1  # positions before the first scored one
        logprobs = [math.nan] * skipped
        special = self.loaded.special_token_ids
        scores = torch.log_softmax(logits[:-1].float(), dim=-1)  # row j scores computed[j + 1]
        if len(computed) > 1:
            target = torch.tensor(computed[1:], device=scores.device).unsqueeze(1)
            logprobs += scores.gather(1, target).squeeze(1).tolist()
        texts = [self.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        out = PromptScores(TokenRun(list(ids), logprobs[:len(ids)], texts,
                                    [t in special for t in ids]))
        n = request.prefill_top_n_tokens
        if n:
            out.top_tokens = [TokenRun() for _ in range(skipped)]
            if len(computed) > 1:
                top_lps, top_ids = scores.topk(n, dim=-1)
                for alt, lps in zip(top_ids.tolist(), top_lps.tolist()):
                    out.top_tokens.append(TokenRun(alt, lps, [self.tokenizer.decode([t]) for t in alt],
                                                   [t in special for t in alt]))
            out.top_tokens = out.top_tokens[:len(ids)]
        asked = request.logprob_token_ids
        if asked:
            out.token_ids_logprobs = [math.nan] * (skipped * len(asked))
            if len(computed) > 1:
                index = torch.tensor(asked, device=scores.device)
                out.token_ids_logprobs += scores.index_select(1, index).flatten().tolist()
            out.token_ids_logprobs = out.token_ids_logprobs[:len(ids) * len(asked)]
        return out

    # ---- helpers ----------------------------------------------------------------------------

    def _state(self, request: NewRequest) -> RequestState:
        stop = StopCriteria(
            max_new_tokens=request.max_new_tokens,
            eos_token_ids=self.loaded.eos_token_ids | frozenset(request.stop_token_ids),
            stop_sequences=list(request.stop_sequences), ignore_eos=request.ignore_eos,
            min_new_tokens=request.min_new_tokens)
        return RequestState(id=request.id, prompt_ids=list(request.input_ids),
                            all_ids=list(request.input_ids), blocks=list(request.blocks), stop=stop,
                            detok=DetokenizerState.start(len(request.input_ids)),
                            skip_special_tokens=request.skip_special_tokens,
                            logprob_token_ids=list(request.logprob_token_ids),
                            return_hidden_states=request.return_hidden_states,
                            beams=self._beams(request),
                            drafter=Drafter() if self.speculate else None)

    def _beams(self, request: NewRequest) -> Beams | None:
        if request.num_beams <= 1:
            return None
        params = request.params
        generator = None
        if params.do_sample:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        options = BeamOptions(request.num_beams, request.length_penalty, params.do_sample,
                              params.temperature, params.top_k, params.top_p)
        search = BeamSearch(options, sorted(self.loaded.eos_token_ids), request.max_new_tokens,
                            generator)
        written = math.ceil(request.prompt_length / self.block_size)  # the prompt's blocks
        return Beams(search, BeamBlocks(request.blocks[:written], request.blocks[written:],
                                        self.block_size))

    def _matcher(self, request: NewRequest):
        return None if request.grammar is None else self.grammars.matcher(*request.grammar)

    def _penalty_ids(self, batch: Batch):
        if not needs_history(batch.sampling):
            return None
        return [(r.prompt_ids, r.output_ids) for r in batch.requests]

    def _pop(self, batch_id: int) -> Batch:
        try:
            return self.batches.pop(batch_id)
        except KeyError:
            raise BatchNotFound(f"batch {batch_id} is not in the shard's cache") from None

    def _info(self, batch: Batch) -> CachedBatch:
        return CachedBatch(id=batch.id, request_ids=batch.request_ids,
                               max_tokens=batch.num_blocks * self.block_size,
                               current_tokens=len(batch.requests))


def _sequence(request: NewRequest) -> PrefillSequence:
    """What the forward computes of a request: the rest of its prompt, or its next chunk."""
    end = (request.cache_len + request.chunk_len if request.is_partial_chunk
           else request.prompt_length)
    if request.input_embeds is not None:
        return PrefillSequence([], request.cache_len, request.blocks,
                               request.input_embeds[request.cache_len:end])
    return PrefillSequence(request.input_ids[request.cache_len:end], request.cache_len,
                           request.blocks)


def _rows_of(batch: Batch, rows: list[int]) -> Batch:
    """The listed rows' requests and sampling state, for choosing their tokens alone (the tensors
    a forward reads are left out: the step already ran)."""
    return Batch(id=batch.id, requests=[batch.requests[r] for r in rows],
                 block_tables=batch.block_tables, seq_lens=batch.seq_lens,
                 next_input_ids=batch.next_input_ids, sampling=batch.sampling.select(rows))


def _extend(generation: Generation, more: Generation) -> None:
    """Appends a later position's token (and all it carries) to a request's generation."""
    for name in ("ids", "logprobs", "texts", "is_special"):
        getattr(generation.tokens, name).extend(getattr(more.tokens, name))
    generation.top_tokens += more.top_tokens
    generation.token_ids_logprobs += more.token_ids_logprobs
    if more.hidden_states is not None:
        generation.hidden_states = torch.cat([generation.hidden_states, more.hidden_states])
    generation.generated_text = more.generated_text


def _logprobs_of(distribution: torch.Tensor, token_ids: list[int]) -> list[float]:
    return distribution[torch.tensor(token_ids, device=distribution.device)].tolist()


def _after_steps(earlier: StepResult, later: StepResult) -> StepResult:
    """`later`, the next step of the same batch, counting `earlier`'s steps and times."""
    later.forward_ns += earlier.forward_ns
    later.decode_ns += earlier.decode_ns
    later.total_ns += earlier.total_ns
    later.steps += earlier.steps
    if later.concat_ns is None:  # the call's first step merged its batches
        later.concat_ns = earlier.concat_ns
    return later


def _merge_steps(earlier: StepResult, later: StepResult) -> StepResult:
    """`earlier` followed by `later`, the next step of the same batch: each request's tokens (with
    all they carry) in order, the last step's batch and finish."""
    generations = {g.request_id: g for g in earlier.generations}
    for step in later.generations:
        if step.request_id in generations:
            _extend(generations[step.request_id], step)
        else:
            earlier.generations.append(step)
    later.generations = earlier.generations
    return _after_steps(earlier, later)


def _banned(states: list) -> list[frozenset[int]] | None:
    """Each request's ids its next token may not be (None when no request has any)."""
    banned = [state.stop.banned_ids() for state in states]
    return banned if any(banned) else None


def _grammar_error(matcher) -> str | None:
    """Why a request's grammar can go no further (llguidance gives up on a grammar its lexer
    finds too complex only as it meets it), or None. Its mask then allows only the end, which
    would have ended the request as if the answer were complete."""
    if matcher is None or not matcher.is_error():
        return None
    reason = matcher.get_error().strip().splitlines() or ["unknown"]
    return f"the grammar could not go on: {reason[0]}"
