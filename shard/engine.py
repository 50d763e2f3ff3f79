"""The shard's engine: its cache of batches (id -> Batch) and its prefill and decode steps.

The steps call each stage's module (admission, generations, speculative_step, beams); plain
dataclasses go in and out, so the gRPC servicer stays a thin converter.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from shard import host_reads, speculative_step
from shard.adapters.adapter_set import AdapterExists, LoadedAdapter
from shard.adapters.peft_files import PeftAdapter
from shard.admission import ModelLimits, admit
from shard.batch_state import (Batch, NewRequest, concatenate_batches, filter_batch, new_batch,
                               sample_batch)
from shard.generations import Vocabulary, prompt_scores, step_generations
from shard.grammar_matcher import GrammarFactory
from shard.images.admission import image_support
from shard.kv_budget import PoolLedger, budget_blocks
from shard.loader import LoadedModel
from shard.model_runner import ModelRunner
from shard.prefill_sequence import sequence_of
from shard.step_rows import QueuedStep, decode_rows, may_run_ahead, queue_next, taken
from shard.prompt_chunks import PromptSoFar, after_chunk, with_earlier
from shard.outputs import (BatchInfo, RequestOutput, StepOutput, WarmupResult, after_steps,
                           merge_steps)


class BatchNotFound(KeyError):
    pass


class AdapterInUse(RuntimeError):
    pass


class Engine:
    def __init__(self, loaded: LoadedModel, runner: ModelRunner, *, memory_fraction: float = 1.0,
                 world_size: int = 1, speculate: int = 0, ledger: PoolLedger | None = None):
        self.loaded = loaded
        self.speculate = speculate  # draft tokens per request and step (0: no speculation)
        self.world_size = world_size
        config = loaded.config
        self.grammars = GrammarFactory(loaded.tokenizer.to_str(), config.vocab_size,
                                       sorted(loaded.eos_token_ids))
        self.tokenizer = loaded.tokenizer
        self.vocab = Vocabulary(loaded.tokenizer, loaded.special_token_ids, loaded.eos_token_ids)
        self.runner = runner
        self.block_size = runner.spec.block_size
        self.limits = ModelLimits(config.vocab_size, config.hidden_size,
                                  config.max_position_embeddings, self.block_size,
                                  runner.model.activation_dtype)
        self.memory_fraction = memory_fraction
        self.ledger = ledger if runner.device.type == "cpu" else None  # CUDA pools are allocated
        self.batches: dict[int, Batch] = {}
        self.images = image_support(runner.model, loaded.image_preprocessor)  # None: text only
        # the chunks so far of a prompt whose every position is asked for (prompt_chunks.py)
        self.prompt_so_far: PromptSoFar | None = None
        # a call's next plain step is queued before this one's tokens are read (step_rows.py):
        # on CUDA, where the device computes while the host reads; the CPU would gain nothing
        # and compute a step for nothing each time a prefill carries the batch
        self.run_ahead = runner.device.type == "cuda"
        self._ahead: QueuedStep | None = None

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.limits.hidden_size

    @property
    def max_positions(self) -> int:
        return self.limits.max_positions

    # ---- public API -------------------------------------------------------------------------

    def warmup(self, requests: list[NewRequest], max_batch_total_tokens: int,
               max_total_tokens: int = 0, max_batch_size: int | None = None) -> WarmupResult:
        """Warm-up: the largest prefill once, then the KV pool sized and the decode step prepared.

        The KV pool is sized from the tokens asked, or a memory budget; the decode step is prepared
        for requests of up to max_total_tokens in batches of up to max_batch_size (None: what the
        pool holds), compiled or captured where it is to be."""
        block_size = self.block_size
        next_block = 1
        for request in requests:
            count = math.ceil((request.prompt_length + 1) / block_size)
            request.blocks = list(range(next_block, next_block + count))
            next_block += count
        self.clear()
        self.runner.allocate(next_block)
        if requests:
            self._prefill_step(requests)
        self.clear()
        bytes_per_block = self.runner.spec.bytes_per_block
        if max_batch_total_tokens:
            num_blocks = math.ceil(max_batch_total_tokens / block_size) + 1
        else:
            self.runner.allocate(1)  # the warm-up's pool is not part of the memory left
            num_blocks = budget_blocks(self.runner.device, self.memory_fraction, self.world_size,
                                       bytes_per_block, self.ledger)
        if num_blocks < 2:
            raise RuntimeError("not enough memory for a single KV block; lower the dtype or "
                               "the model size, raise --cuda-memory-fraction, or fix the pool's "
                               "size with --max-batch-total-tokens")
        self.runner.allocate(num_blocks)
        if self.ledger is not None:
            self.ledger.record(num_blocks * bytes_per_block)
        self.runner.warm_decode(max_total_tokens, max_batch_size)
        return WarmupResult(num_blocks=num_blocks, block_size=block_size)

    def prefill(self, batch_id: int, requests: list[NewRequest],
                cached_batch_id: int | None = None) -> StepOutput:
        """A prefill step: new prompts, or one chunk of a long one.

        With `cached_batch_id`, that running batch also takes its next step in the same forward and
        the new requests join it."""
        start = time.perf_counter_ns()
        is_chunk = any(r.is_partial_chunk for r in requests)
        if is_chunk and len(requests) != 1:
            raise ValueError("a chunk that stops short of its prompt's end must be prefilled alone")
        if cached_batch_id is not None and cached_batch_id not in self.batches:
            raise BatchNotFound(cached_batch_id)
        requests, unknown = self._with_adapter_slots(requests)
        requests, rejected = admit(requests, self.limits, self.runner.num_blocks, self.grammars,
                                   self.images)
        rejected = unknown + rejected
        if not requests:  # nothing new to compute: the riding batch takes a plain step
            result = (self.decode([cached_batch_id]) if cached_batch_id is not None
                      else StepOutput([], None))
            result.rejected = rejected
            return result
        running = self._pop(cached_batch_id) if cached_batch_id is not None else None
        batch, generations, forward_ns = self._prefill_step(requests, batch_id, running)
        if batch is None:
            return StepOutput([], None, forward_ns=forward_ns, decode_ns=0,
                              total_ns=time.perf_counter_ns() - start, rejected=rejected)
        result = self._finish_step(batch, generations, start, forward_ns)
        result.rejected = rejected
        return result

    def decode(self, batch_ids: list[int], max_steps: int = 1,
               on_step: Callable[[StepOutput], None] | None = None) -> StepOutput:
        """Up to `max_steps` decode steps of the batches (merged), back to back.

        One call's round trip for several tokens when nothing else is due. It stops after a step in
        which a request finished (the router drops it before the next), and takes one step when
        speculating or when the batch holds a beam-search request (their steps are not plain
        ones). Each step's tokens are added to their requests' Generations, as speculation's
        accepted tokens are; with `on_step`, every step but the last is handed to it instead as
        it ends (to be streamed), and the result holds the last step's Generations with the
        whole call's steps and times."""
        # a step of a call of several is queued before the one before it is read; the last
        # one's next step too, which the next call takes unless a prefill comes first
        ahead = max_steps > 1
        try:
            result = self._decode_step(batch_ids, ahead)
            while result.steps < max_steps and self._may_step_again(result):
                if on_step is None:
                    result = merge_steps(result, self._decode_step([result.batch.id], ahead))
                else:
                    on_step(result)  # before the next step: its tokens go out while it computes
                    result = after_steps(result, self._decode_step([result.batch.id], ahead))
        except BaseException:
            self._ahead = None
            raise
        if result.batch is None:
            self._ahead = None
        return result

    def filter(self, batch_id: int, request_ids: list[int]) -> BatchInfo:
        if not request_ids:
            raise ValueError("FilterBatch needs at least one request id; use ClearCache to drop a batch")
        batch = filter_batch(self._pop(batch_id), request_ids)
        self.batches[batch.id] = batch
        if self._ahead is not None and self._ahead.batch_id == batch_id:
            self._ahead = self._ahead.kept(request_ids)
        return self._info(batch)

    def read_adapter(self, name: str, path: str) -> PeftAdapter:
        """An adapter's files, read and checked on a thread other than the engine's.

        It touches nothing the engine thread changes. AdapterError for an adapter this model
        cannot take; AdapterExists."""
        if name in self.runner.adapters.adapters:  # refused before reading; install checks again
            raise AdapterExists(f"an adapter named {name!r} is already loaded")
        return self.runner.adapters.read(path)

    def install_adapter(self, name: str, adapter: PeftAdapter) -> LoadedAdapter:
        """A read adapter placed in its slot; AdapterExists (nothing changed)."""
        return self.runner.adapters.install(name, adapter)

    def load_adapter(self, name: str, path: str) -> LoadedAdapter:
        """read_adapter, then install_adapter, on this thread."""
        return self.install_adapter(name, self.read_adapter(name, path))

    def unload_adapter(self, name: str) -> int:
        """Frees `name`; the bytes the adapters left hold.

        KeyError for a name not loaded; AdapterInUse while a batch held here uses it. Its
        tensors are freed, and their memory given back to the system."""
        slot = self.runner.adapters.slot_of(name)
        users = [r.id for b in self.batches.values() for r in b.requests if r.adapter_slot == slot]
        if users:
            raise AdapterInUse(f"adapter {name!r} is in use by requests {users[:8]}")
        moved = self.runner.adapters.unload(name)
        for batch in self.batches.values():  # the last slot's adapter moved into the freed one
            for request in batch.requests:
                request.adapter_slot = moved.get(request.adapter_slot, request.adapter_slot)
        self.runner.adapters_changed()
        return self.runner.adapters.tensor_bytes()

    def _with_adapter_slots(self, requests: list[NewRequest]
                            ) -> tuple[list[NewRequest], list[tuple[int, str]]]:
        """The requests whose adapter is loaded (their slot set), and (id, why) of the rest."""
        kept, rejected = [], []
        for request in requests:
            if request.adapter is not None:
                try:
                    request.adapter_slot = self.runner.adapters.slot_of(request.adapter)
                except KeyError:
                    rejected.append((request.id, f"LoRA adapter {request.adapter!r} is not "
                                                 "loaded on this shard"))
                    continue
            kept.append(request)
        return kept, rejected

    def clear(self, batch_id: int | None = None) -> None:
        if batch_id is None or (self._ahead is not None and self._ahead.batch_id == batch_id):
            self._ahead = None
        if batch_id is None:
            self.batches.clear()
            self.prompt_so_far = None
        else:
            self.batches.pop(batch_id, None)

    # ---- steps ------------------------------------------------------------------------------

    def _may_step_again(self, result: StepOutput) -> bool:
        if result.batch is None or self.speculate or any(
                g.generated_text is not None for g in result.generations):
            return False
        return not any(s.beams is not None for s in self.batches[result.batch.id].requests)

    def _decode_step(self, batch_ids: list[int], ahead: bool = False) -> StepOutput:
        """One decode step of the batches (merged); `ahead`: the call takes another after it."""
        start = time.perf_counter_ns()
        batches = [self._pop(i) for i in batch_ids]
        concat_ns = None
        if len(batches) > 1:
            before = time.perf_counter_ns()
            batch = concatenate_batches(batches)
            concat_ns = time.perf_counter_ns() - before
        else:
            batch = batches[0]
        drafts = speculative_step.drafts(batch, self.speculate)
        verifies = drafts is not None and any(drafts)
        queued, self._ahead = taken(self._ahead, batch), None
        before = time.perf_counter_ns()
        if verifies:
            rows = speculative_step.verify_rows(batch, drafts, self.runner.device)
            out = self.runner.decode(rows.input_ids, rows.seq_lens, rows.block_tables,
                                     rows.adapter_slots, rows.rope_deltas)
            forward_ns = spent_ns = time.perf_counter_ns() - before
            generations = speculative_step.accept(batch, drafts, out.logits, out.hidden,
                                                  self.vocab)
        else:  # nothing to verify: a plain step, at a plain step's cost
            if queued is not None:  # queued by the step before
                out, first, forward_ns, spent_ns = queued.out, None, queued.forward_ns, 0
            else:
                rows, first = decode_rows(batch, self.runner)
                out = self.runner.decode(rows.input_ids, rows.seq_lens, rows.block_tables,
                                         rows.adapter_slots, rows.rope_deltas)
                forward_ns = spent_ns = time.perf_counter_ns() - before
            generations = self._step_rows(batch, out.logits, out.hidden, first,
                                          ahead=ahead and self.run_ahead and drafts is None)
            if self._ahead is not None:  # the next step's forward, queued in this one
                spent_ns += self._ahead.forward_ns
        accepted = 0
        if drafts is not None:  # each request's record of guesses (sent or only checked)
            accepted = speculative_step.observe(batch, drafts, generations)
        result = self._finish_step(batch, generations, start, forward_ns, spent_ns)
        result.concat_ns = concat_ns
        if verifies:
            result.draft_tokens = sum(len(d) for d in drafts)
            result.accepted_tokens = accepted
        return result

    def _prefill_step(self, requests: list[NewRequest], batch_id: int = 0,
                      running: Batch | None = None):
        """One prefill forward: (the batch to keep, its outputs, the forward's time).

        The batch to keep is the new requests, the running one, or both merged under the running
        one's id; None when a partial chunk ran alone."""
        is_chunk = any(r.is_partial_chunk for r in requests)
        seqs = [sequence_of(r) for r in requests]
        # a partial chunk's token comes with the last chunk; its positions' scores and hidden
        # states, when asked, are kept until then (shard/prompt_chunks.py)
        logits_rows = {i for i, r in enumerate(requests) if r.computes_every_position}
        hidden_only = {i for i in logits_rows if not requests[i].prefill_logprobs}
        decode, first, queued = None, None, None
        if running is not None:  # its next step queued by the last decode call, or riding here
            queued, self._ahead = taken(self._ahead, running), None
            if queued is None:
                decode, first = decode_rows(running, self.runner)
        before = time.perf_counter_ns()
        out = self.runner.prefill(seqs, all_logits_rows=logits_rows, hidden_only_rows=hidden_only,
                                  decode=decode)
        forward_ns = time.perf_counter_ns() - before
        batches, generations = [], []
        if running is not None:
            logits, hidden = ((out.decode, out.decode_hidden) if queued is None
                              else (queued.out.logits, queued.out.hidden))
            generations += self._step_rows(running, logits, hidden, first)
            batches.append(running)
        held = self.prompt_so_far
        if is_chunk and held is not None and not held.continues(requests[0]):
            # another long prompt's chunk: the router gave up the held one (its client left)
            held = self.prompt_so_far = None
        if is_chunk and requests[0].computes_every_position:
            self.prompt_so_far = after_chunk(held, requests[0], out.full[0], out.hidden[0],
                                             self.vocab)
        if not is_chunk:
            batch = new_batch(batch_id, requests, self.runner.device,
                              eos_token_ids=self.loaded.eos_token_ids,
                              block_size=self.block_size, speculate=self.speculate)
            output = sample_batch(out.last, batch)
            batch.next_input_ids = output.next_ids
            hidden = [with_earlier(held, r, h) for r, h in zip(requests, out.hidden)]
            new_generations = step_generations(batch, output, hidden, out.last, self.vocab)
            for i, request in enumerate(requests):
                if request.prefill_logprobs and new_generations[i] is not None:
                    earlier = held.scores if held and held.continues(request) else None
                    new_generations[i].prompt = prompt_scores(request, out.full[i], self.vocab,
                                                              earlier)
            if held is not None and any(held.continues(r) for r in requests):
                self.prompt_so_far = None
            generations += [g for g in new_generations if g is not None]
            batches.append(batch)
        if not batches:
            return None, generations, forward_ns
        return (batches[0] if len(batches) == 1 else concatenate_batches(batches),
                generations, forward_ns)

    def _finish_step(self, batch: Batch, generations: list[RequestOutput], start: int,
                     forward_ns: int, spent_ns: int | None = None) -> StepOutput:
        """The step's output; `spent_ns`: the forwards' time within it (default forward_ns).

        A step whose forward was queued by the step before spent none of it here, and a step
        that queues the next one spent that one's."""
        decode_ns = time.perf_counter_ns() - start - (forward_ns if spent_ns is None else spent_ns)
        info = None
        if any(r.finish_reason is None for r in batch.requests):
            self.batches[batch.id] = batch
            info = self._info(batch)
        return StepOutput(generations, info, forward_ns=forward_ns, decode_ns=decode_ns,
                          total_ns=time.perf_counter_ns() - start)

    def _step_rows(self, batch: Batch, logits: torch.Tensor, hidden: torch.Tensor,
                   first: list[int] | None, *, ahead: bool = False) -> list[RequestOutput]:
        """The decode step's outputs (rows from decode_rows) -> each request's generation.

        `ahead`: the next step's forward is queued once the tokens are drawn, where it may be."""
        batch.seq_lens = batch.seq_lens + 1
        row_logits, row_hidden = logits, hidden
        if first is not None:  # one row per request for sampling; beams read all of theirs
            index = torch.tensor(first, dtype=torch.long, device=logits.device)
            row_logits, row_hidden = logits[index], hidden[index]
        output = sample_batch(row_logits, batch)
        batch.next_input_ids = output.next_ids
        pending = None
        if ahead and may_run_ahead(batch):
            # the reads first: the wait for them must not wait for the step queued after them
            pending = host_reads.start(output.next_ids, output.logprobs, output.top_ids,
                                       output.top_logprobs)
            self._ahead = queue_next(batch, self.runner, self.world_size == 1)
        # a row's hidden states are sliced out only for a request that asks for them
        hidden_rows = [row_hidden[row:row + 1] if state.return_hidden_states else None
                       for row, state in enumerate(batch.requests)]
        generations = step_generations(batch, output, hidden_rows, logits, self.vocab, first,
                                       pending)
        return [g for g in generations if g is not None]

    # ---- helpers ----------------------------------------------------------------------------

    def _pop(self, batch_id: int) -> Batch:
        try:
            return self.batches.pop(batch_id)
        except KeyError:
            raise BatchNotFound(f"batch {batch_id} is not in the shard's cache") from None

    def _info(self, batch: Batch) -> BatchInfo:
        return BatchInfo(id=batch.id, request_ids=batch.request_ids, current_tokens=len(
            batch.requests), max_tokens=batch.num_blocks * self.block_size)
