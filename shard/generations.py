"""Token post-processing: each chosen token appended, detokenised, checked for a stop, and reported.

The Generation the router receives is built from each token (top tokens, asked ids'
log-probabilities, hidden states, a finished beam search's answer); the prompt's own scores are
computed here too."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from shard import host_reads
from shard.batch_state import Batch, NewRequest, RequestState
from shard.beams import advance as advance_beams
from shard.detokenizer import decode_next, flush
from shard.grammar_matcher import advance
from shard.outputs import GeneratedText, PromptScores, RequestOutput, TokenRun
from shard.sampling import SampleOutput
from shard.stopping import FinishReason


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What turns token ids into the router's text."""

    tokenizer: Tokenizer
    special_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]

    def runs(self, ids: list[int], logprobs: list[float]) -> TokenRun:
        """Tokens decoded one by one (a top-n list, not a stream)."""
        return TokenRun(ids, logprobs, [self.tokenizer.decode([t]) for t in ids],
                        [t in self.special_token_ids for t in ids])


def step_generations(batch: Batch, output: SampleOutput, hidden: list[torch.Tensor | None],
                     logits: torch.Tensor, vocab: Vocabulary, first: list[int] | None = None,
                     pending: host_reads.PendingRead | None = None
                     ) -> list[RequestOutput | None]:
    """Each row's token appended, detokenised and checked for stopping (a Python loop by nature).

    `hidden` holds, per row, the final hidden states this step computed for it; `logits` and
    `first` are the step's rows (see step_rows.decode_rows), which a beam-search request reads
    all of (its generation is None until its search ends). `pending`: the reads of `output`'s
    tokens, log-probabilities and top tokens, already begun."""
    # the step's one wait for the device
    if pending is not None:
        ids, logprobs, top_ids, top_lps = pending.wait()
    else:
        ids, logprobs, top_ids, top_lps = host_reads.read(output.next_ids, output.logprobs,
                                                          output.top_ids, output.top_logprobs)
    if batch.sampling.flags["grammar"]:
        advance(batch.sampling.grammars, ids)
    generations = []
    for row, state in enumerate(batch.requests):
        if state.beams is not None:
            start = row if first is None else first[row]
            best = advance_beams(state.beams, logits[start:start + state.beams.search.width],
                                 state.id)
            generations.append(None if best is None else _beam_answer(state, best, vocab))
            continue
        generation = _token_generation(batch, row, ids[row], logprobs[row], vocab)
        n = batch.sampling.params[row].top_n_tokens
        if n and top_ids is not None:
            generation.top_tokens = [vocab.runs(top_ids[row][:n], top_lps[row][:n])]
        if state.logprob_token_ids:
            generation.token_ids_logprobs = _logprobs_of(output.log_distribution()[row],
                                                         state.logprob_token_ids)
        if state.return_hidden_states:
            generation.hidden_states = hidden[row].float().cpu()
        generations.append(generation)
    return generations


def _token_generation(batch: Batch, row: int, token: int, logprob: float,
                      vocab: Vocabulary) -> RequestOutput:
    """The row's request takes `token`: its text, and its end when it stops here."""
    state = batch.requests[row]
    tokenizer = vocab.tokenizer
    state.all_ids.append(token)
    text = decode_next(tokenizer, state.all_ids, state.detok, state.skip_special_tokens)
    reason = state.stop.check(token, text)
    broken = grammar_error(batch.sampling.grammars[row])
    if broken is not None and reason is None:
        reason = FinishReason.EOS_TOKEN  # it ends here; the router hears `broken`
    generated = None
    if reason is FinishReason.STOP_SEQUENCE:
        # TGI keeps the stop sequence in the output, and nothing after it
        text = text[:len(text) - state.stop.excess_chars]
    elif reason is not None:
        text += flush(tokenizer, state.all_ids, state.detok, state.skip_special_tokens)
    if reason is not None:
        state.finish_reason = reason
    state.text.append(text)
    if reason is not None:
        params = batch.sampling.params[row]
        generated = GeneratedText("".join(state.text), state.stop.num_generated, reason,
                                  params.seed if params.do_sample else None)
    tokens = TokenRun([token], [logprob], [text], [token in vocab.special_token_ids])
    return RequestOutput(state.id, tokens, generated_text=generated, error=broken)


def _beam_answer(state: RequestState, best: list[int], vocab: Vocabulary) -> RequestOutput:
    """A finished beam search's generation: the best hypothesis.

    Its text is decoded as a stream of it would have been."""
    tokenizer = vocab.tokenizer
    text = []
    for token in best:
        state.all_ids.append(token)
        text.append(decode_next(tokenizer, state.all_ids, state.detok, state.skip_special_tokens))
    text.append(flush(tokenizer, state.all_ids, state.detok, state.skip_special_tokens))
    text = "".join(text)
    reason = FinishReason.EOS_TOKEN if best[-1] in vocab.eos_token_ids else FinishReason.LENGTH
    state.finish_reason = reason
    generator = state.beams.search.generator
    generated = GeneratedText(text, len(best), reason,
                              generator.initial_seed() if generator is not None else None,
                              token_ids=best)
    last = best[-1]
    # one run for the whole answer: all of its text arrives with this step
    return RequestOutput(state.id, TokenRun([last], [math.nan], [text],
                                         [last in vocab.special_token_ids]),
                      generated_text=generated)


def prompt_scores(request: NewRequest, logits: torch.Tensor, vocab: Vocabulary,
                  earlier: PromptScores | None = None) -> PromptScores:
    """Prompt tokens with log p(token | earlier tokens), the top tokens and asked ids' logprobs.

    `logits`: the rows of the positions this forward computed, from request.cache_len to the
    prompt's end; `earlier`: what the prompt's earlier chunks scored (skipped_positions, then
    chunk_scores of each). The top tokens and the asked ids' log-probabilities come at each
    position; the first position has none (NaN, empty)."""
    ids = request.input_ids
    out = earlier if earlier is not None else skipped_positions(request, request.cache_len)
    add_scores(out, chunk_scores(request, logits, request.cache_len, vocab, is_last=True))
    texts = [vocab.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    out.tokens = TokenRun(list(ids), out.tokens.logprobs[:len(ids)], texts,
                          [t in vocab.special_token_ids for t in ids])
    out.top_tokens = out.top_tokens[:len(ids)]
    out.token_ids_logprobs = out.token_ids_logprobs[:len(ids) * len(request.logprob_token_ids)]
    return out


def skipped_positions(request: NewRequest, start: int) -> PromptScores:
    """Positions 0 to `start`, which no computed row scores: NaN and empty."""
    count = start + 1
    return PromptScores(TokenRun(logprobs=[math.nan] * count),
                        [TokenRun() for _ in range(count)] if request.prefill_top_n_tokens else [],
                        [math.nan] * (count * len(request.logprob_token_ids)))


def chunk_scores(request: NewRequest, logits: torch.Tensor, start: int, vocab: Vocabulary, *,
                 is_last: bool) -> PromptScores:
    """What the rows of positions start.. score: each the prompt token after it.

    The prompt's last row scores no prompt token (it chose the first new one)."""
    rows = logits[:-1] if is_last else logits
    targets = request.input_ids[start + 1:start + 1 + rows.shape[0]]
    out = PromptScores(TokenRun())
    if not targets:
        return out
    scores = torch.log_softmax(rows.float(), dim=-1)
    target = torch.tensor(targets, device=scores.device).unsqueeze(1)
    out.tokens.logprobs = scores.gather(1, target).squeeze(1).tolist()
    if request.prefill_top_n_tokens:
        top_lps, top_ids = scores.topk(request.prefill_top_n_tokens, dim=-1)
        out.top_tokens = [vocab.runs(alt, lps) for alt, lps in zip(top_ids.tolist(),
                                                                    top_lps.tolist())]
    if request.logprob_token_ids:
        index = torch.tensor(request.logprob_token_ids, device=scores.device)
        out.token_ids_logprobs = scores.index_select(1, index).flatten().tolist()
    return out


def add_scores(into: PromptScores, more: PromptScores) -> None:
    """Appends the positions `more` scores to those `into` holds."""
    into.tokens.logprobs += more.tokens.logprobs
    into.top_tokens += more.top_tokens
    into.token_ids_logprobs += more.token_ids_logprobs


def grammar_error(matcher) -> str | None:
    """Why a request's grammar can go no further, or None.

    llguidance gives up on a grammar its lexer finds too complex only as it meets it. Its mask then
    allows only the end, which would have ended the request as if the answer were complete."""
    if matcher is None or not matcher.is_error():
        return None
    reason = matcher.get_error().strip().splitlines() or ["unknown"]
    return f"the grammar could not go on: {reason[0]}"


def _logprobs_of(distribution: torch.Tensor, token_ids: list[int]) -> list[float]:
    return distribution[torch.tensor(token_ids, device=distribution.device)].tolist()
