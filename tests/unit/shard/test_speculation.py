"""N-gram speculation: the drafts proposed, and steps that verify them answer as plain steps do."""
import math

import pytest
import torch

from shard import speculative_step
from shard.speculation import RECORD_DECAY, Drafter, NgramIndex, acceptance_threshold
from tests.engine_helpers import BlockPool, make_engine, request, steps_to_completion


def test_the_latest_earlier_occurrence_of_the_longest_suffix_is_continued():
    index = NgramIndex()
    # suffix (7, 8) occurred twice, followed by 1 then by 2; the latest one wins
    ids = [7, 8, 1, 5, 7, 8, 2, 6, 7, 8]
    assert index.propose(ids, 3) == [2, 6, 7]
    # a longer suffix beats a more recent shorter one: (4, 7, 8) only occurred at the start
    assert NgramIndex().propose([4, 7, 8, 3, 9, 7, 8, 5, 4, 7, 8], 2) == [3, 9]


def test_no_draft_without_an_earlier_occurrence_and_the_count_is_a_cap():
    assert NgramIndex().propose([1, 2, 3], 4) == []
    assert NgramIndex().propose([1, 2, 3, 1], 0) == []
    assert NgramIndex().propose([5, 6, 5], 10) == [6, 5]  # what followed, up to the end


def test_an_index_kept_up_to_date_proposes_what_a_fresh_one_would():
    ids, kept = [], NgramIndex()
    for token in [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]:
        ids.append(token)
        assert kept.propose(ids, 3) == NgramIndex().propose(list(ids), 3)


def test_drafting_pays_in_a_small_batch_at_a_low_acceptance_and_in_a_large_one_at_a_high():
    assert acceptance_threshold(1) < 0.2
    assert acceptance_threshold(8) == pytest.approx(8 / 14)
    assert 0.6 < acceptance_threshold(32) < acceptance_threshold(64) < 1


def test_a_draft_is_as_long_as_its_tokens_are_likely_enough_to_hold():
    ids = [1, 2, 3, 4, 5, 6, 1]  # proposes 2, 3, 4, 5
    fresh = Drafter()  # a guess is taken to hold half the time: 0.5, 0.25, 0.125, 0.0625
    assert fresh.drafts(ids, 4, 0.1) == [2, 3, 4]
    assert fresh.drafts(ids, 4, 0.3) == [2]
    assert fresh.drafts(ids, 4, 0.6) == [] and fresh.shadow == 2


def test_a_request_whose_guesses_fail_stops_drafting_and_starts_again_when_they_would_hold():
    drafter = Drafter()
    ids = [1, 2, 3, 1, 2]
    assert drafter.drafts(ids, 2, 0.3) == [3]
    for _ in range(4):  # rejected outright, step after step
        drafter.observe([3], [9])
    assert drafter.drafts(ids, 2, 0.3) == [] and drafter.shadow == 3
    for _ in range(6):  # the unsent guess would have held
        drafter.observe([], [3])
    assert drafter.drafts(ids, 2, 0.3) == [3, 1]
    for _ in range(10):  # whole drafts accepted, each with the model's own next token
        drafter.observe([3, 1], [3, 1, 7])
    assert drafter.hit_rate > 0.9
    hits, checks = drafter.hits, drafter.checks
    drafter.observe([3, 1], [3, 8])  # the second token did not hold: two checked, one hit
    assert drafter.hits == pytest.approx(hits * RECORD_DECAY + 1)
    assert drafter.checks == pytest.approx(checks * RECORD_DECAY + 2)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return make_engine(tiny_llama), make_engine(tiny_llama, speculate=4)


def _run(engine, requests):
    """Each request's generations, and the speculation counts of the decode steps."""
    got = {r.id: [] for r in requests}
    drafted = accepted = 0
    for out in steps_to_completion(engine, requests):
        for generation in out.generations:
            got[generation.request_id].append(generation)
        drafted += out.draft_tokens
        accepted += out.accepted_tokens
    assert engine.batches == {}
    return got, drafted, accepted


def _flat(generations):
    """Per token: id, text, log-probability, top tokens; and the final text, count and reason."""
    tokens = []
    for g in generations:
        for i, token in enumerate(g.tokens.ids):
            tops = g.top_tokens[i] if g.top_tokens else None
            tokens.append((token, g.tokens.texts[i], g.tokens.logprobs[i],
                           None if tops is None else tops.ids))
    final = generations[-1].generated_text
    return tokens, (final.text, final.generated_tokens, final.finish_reason)


def _requests(engine, pool):
    encode = lambda text: engine.tokenizer.encode(text).ids  # noqa: E731
    repetitive = encode("one two three four one two three four one two three four one two")
    specs = [
        (repetitive, dict(max_new_tokens=24, ignore_eos=True)),
        (encode("The quick brown fox jumps over the lazy dog. The quick brown"),
         dict(max_new_tokens=17, top_n_tokens=3)),
        (repetitive, dict(max_new_tokens=20, do_sample=True, seed=7, temperature=0.7, top_k=20,
                          ignore_eos=True)),
        (encode("a b a b a b a b"), dict(max_new_tokens=19, repetition_penalty=1.3,
                                         frequency_penalty=0.2, ignore_eos=True)),
        (repetitive, dict(max_new_tokens=30, stop_sequences=["four one"])),
        (encode("Paris Paris Paris"), dict(max_new_tokens=3, ignore_eos=True)),
        (repetitive, dict(max_new_tokens=12, grammar=("regex", "( ?[a-z]+){1,12}"))),
        (repetitive, dict(max_new_tokens=10, ignore_eos=True, return_hidden_states=True,
                          logprob_token_ids=[5, 17])),
    ]
    out = []
    for rid, (prompt, params) in enumerate(specs):
        extra = {k: params.pop(k) for k in ("grammar", "return_hidden_states",
                                             "logprob_token_ids") if k in params}
        # exactly the slots the router reserves: the prompt and every new token but the last
        blocks = pool.take(len(prompt) + params["max_new_tokens"] - 1, 4)
        out.append(request(rid, prompt, blocks, **params))
        for name, value in extra.items():
            setattr(out[-1], name, value)
    return out


def _assert_same_answers(got, want):
    for rid in want:
        want_tokens, want_final = _flat(want[rid])
        got_tokens, got_final = _flat(got[rid])
        assert got_final == want_final, rid
        assert [t[0] for t in got_tokens] == [t[0] for t in want_tokens], rid
        assert [t[1] for t in got_tokens] == [t[1] for t in want_tokens], rid
        assert [t[3] for t in got_tokens] == [t[3] for t in want_tokens], rid
        for (_, _, lp_got, _), (_, _, lp_want, _) in zip(got_tokens, want_tokens):
            assert math.isclose(lp_got, lp_want, abs_tol=1e-4), rid
        asked = [v for g in got[rid] for v in g.token_ids_logprobs]
        assert asked == pytest.approx([v for g in want[rid] for v in g.token_ids_logprobs],
                                      abs=1e-4)
        hidden = [g.hidden_states for g in got[rid] if g.hidden_states is not None]
        if hidden:  # the prompt's rows with the first token, then one row per token
            assert all(g.hidden_states.shape[0] == len(g.tokens.ids) for g in got[rid][1:])
            assert torch.allclose(torch.cat(hidden),
                                  torch.cat([g.hidden_states for g in want[rid]]), atol=1e-4)


def test_speculative_steps_answer_token_for_token_as_plain_steps(engines, monkeypatch):
    """Drafts that are right for a while and then wrong (and sometimes right to the end), for
    greedy, seeded sampling, penalties, a stop sequence, a grammar, hidden states and asked
    log-probabilities: every token, text, log-probability and final answer as without them."""
    plain, speculative = engines
    want, _, _ = _run(plain, _requests(plain, BlockPool(512)))
    requests = _requests(speculative, BlockPool(512))
    answers = [r.input_ids + [t for g in want[r.id] for t in g.tokens.ids] for r in requests]
    vocab = speculative.vocab_size

    def oracle(self, ids, count):
        """The plain run's next tokens, the first `right` of them true and then one wrong."""
        answer = next(a for a in answers if a[:len(ids)] == ids)
        truth = answer[len(ids):len(ids) + count]
        right = len(ids) % (count + 1)
        return (truth[:right] + [(t + 1) % vocab for t in truth[right:right + 1]])[:count]

    monkeypatch.setattr(NgramIndex, "propose", oracle)
    monkeypatch.setattr(speculative_step, "acceptance_threshold", lambda rows: 0.0)  # all draft
    got, drafted, accepted = _run(speculative, requests)
    assert 0 < accepted < drafted
    for rid in range(len(requests)):
        if len(want[rid]) > 3:
            assert any(len(g.tokens.ids) > 2 for g in got[rid]), rid
    _assert_same_answers(got, want)


def test_ngram_drafts_are_accepted_and_change_nothing(engines):
    plain, speculative = engines
    want, _, _ = _run(plain, _requests(plain, BlockPool(512)))
    got, drafted, accepted = _run(speculative, _requests(speculative, BlockPool(512)))
    assert drafted > 0 and accepted > 0, "the drafts were verified and some accepted"
    _assert_same_answers(got, want)


def test_drafts_never_write_past_the_slots_reserved_for_a_request(engines, monkeypatch):
    _, speculative = engines
    runner = speculative.runner
    seen = []
    original = runner.decode

    def recording(input_ids, seq_lens, block_tables, adapter_slots=None, rope_deltas=None):
        seen.append((seq_lens.tolist(), block_tables.shape[1]))
        return original(input_ids, seq_lens, block_tables, adapter_slots, rope_deltas)

    monkeypatch.setattr(runner, "decode", recording)
    prompt = speculative.tokenizer.encode("x y x y x y x y x y x y x").ids
    max_new = 9
    blocks = BlockPool(512).take(len(prompt) + max_new - 1, 4)
    got, drafted, _ = _run(speculative, [request(0, prompt, blocks, max_new_tokens=max_new,
                                                 ignore_eos=True)])
    assert drafted > 0
    assert sum(len(g.tokens.ids) for g in got[0]) == max_new
    # the last slot of the reservation is position prompt + max_new - 2
    assert max(max(lengths) for lengths, _ in seen) <= len(prompt) + max_new - 2


def test_a_large_batch_drafts_only_for_requests_whose_drafts_hold(tiny_llama, monkeypatch):
    engine = make_engine(tiny_llama, speculate=4)
    prompt = engine.tokenizer.encode("one two three one two three one two three one").ids
    pool = BlockPool(512)
    requests = [request(i, prompt, pool.take(len(prompt) + 12, 4), max_new_tokens=12,
                        ignore_eos=True) for i in range(2)]

    def wrong(self, ids, count):  # always a guess, never a right one
        return [(ids[-1] + 1) % engine.vocab_size] * count

    monkeypatch.setattr(NgramIndex, "propose", wrong)
    _, drafted, accepted = _run(engine, requests)
    assert accepted == 0
    # each request drafted until its estimate fell under the threshold of a batch of 2, then
    # only watched (12 tokens: 11 decode steps, 4 drafts each had they gone on)
    assert 0 < drafted < 2 * 11 * 4


def test_a_drafting_batch_that_rides_a_prefill_of_refused_requests_answers_it(engines,
                                                                               monkeypatch):
    """Every new request refused: the riding batch takes its step alone, drafts included, and
    the Prefill's reply (which has no draft counts) still goes out."""
    from proto import generate_pb2 as pb
    from shard.convert import step_response

    _, speculative = engines
    monkeypatch.setattr(speculative_step, "acceptance_threshold", lambda rows: 0.0)
    pool = BlockPool(512)
    prompt = speculative.tokenizer.encode("a b c a b c a b c a b").ids
    out = speculative.prefill(1, [request(0, prompt, pool.take(len(prompt) + 12, 4),
                                          max_new_tokens=12, ignore_eos=True)])
    bad = request(1, prompt, [10_000], max_new_tokens=4)  # a block outside the pool
    result = speculative.prefill(2, [bad], cached_batch_id=out.batch.id)
    assert [rid for rid, _ in result.rejected] == [1] and result.draft_tokens > 0
    reply = step_response(result, pb.PrefillResponse)
    assert [g.request_id for g in reply.generations] == [0]
    assert len(reply.generations[0].tokens.ids) >= 1 and reply.rejected[0].request_id == 1
    speculative.clear()


def test_a_draft_token_a_request_stops_on_counts_as_accepted(engines, monkeypatch):
    """The accepted count is the number of draft tokens chosen, also when the request stops (here
    on a stop sequence) on one of them rather than on the step's own token."""
    plain, speculative = engines
    prompt = plain.tokenizer.encode("one two three four one two three four one two").ids
    pool = BlockPool(512)
    free, = _run(plain, [request(0, prompt, pool.take(len(prompt) + 11, 4), max_new_tokens=12,
                                 ignore_eos=True)])[0].values()
    answer = prompt + [t for g in free for t in g.tokens.ids]
    # the first decode step drafts the 2nd to 5th tokens: stop on the 4th, a draft token
    stop = "".join([text for g in free for text in g.tokens.texts][:4])

    def oracle(self, ids, count):  # always the plain run's next tokens
        return answer[len(ids):len(ids) + count]

    monkeypatch.setattr(NgramIndex, "propose", oracle)
    monkeypatch.setattr(speculative_step, "acceptance_threshold", lambda rows: 0.0)
    stopping = dict(max_new_tokens=12, ignore_eos=True, stop_sequences=[stop])
    want, _, _ = _run(plain, [request(0, prompt, pool.take(len(prompt) + 11, 4), **stopping)])
    got, drafted, accepted = _run(speculative, [request(0, prompt, pool.take(len(prompt) + 11, 4),
                                                        **stopping)])
    _assert_same_answers(got, want)
    assert [len(g.tokens.ids) for g in got[0]] == [1, 3], "stopped on the third of four drafts"
    assert (drafted, accepted) == (4, 3)


def test_a_batch_holding_a_beam_search_takes_plain_steps_and_drafts_after_it(engines,
                                                                             monkeypatch):
    """Beams and drafts in one batch: no draft while the beam search runs (its rows are beams),
    drafting once it has finished, and every answer as a plain engine gives it."""
    plain, speculative = engines
    monkeypatch.setattr(speculative_step, "acceptance_threshold", lambda rows: 0.0)
    prompt = plain.tokenizer.encode("one two three four one two three four one two").ids

    def batch(engine):
        pool = BlockPool(512)
        per_beam = -(-(len(prompt) + 4 - 1) // 4)
        beam = request(0, prompt, pool.take((2 * per_beam + 1) * 4, 4), max_new_tokens=4)
        beam.num_beams = 2
        return [beam, request(1, prompt, pool.take(len(prompt) + 20, 4), max_new_tokens=20,
                              ignore_eos=True)]

    want, _, _ = _run(plain, batch(plain))
    got = {0: [], 1: []}
    drafts_with_beams = drafts_after = 0
    beams_done = False
    for out in steps_to_completion(speculative, batch(speculative)):
        if beams_done:
            drafts_after += out.draft_tokens
        else:
            drafts_with_beams += out.draft_tokens
        for generation in out.generations:
            got[generation.request_id].append(generation)
            beams_done |= generation.request_id == 0 and generation.generated_text is not None
    assert speculative.batches == {}
    assert beams_done and drafts_with_beams == 0 and drafts_after > 0
    assert got[0][-1].generated_text.text == want[0][-1].generated_text.text
    _assert_same_answers({1: got[1]}, {1: want[1]})
