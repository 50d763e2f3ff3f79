"""The engine's batch lifecycle: prefill, decode of merged batches, filter, and batch invariance."""
import pytest

from shard.engine import BatchNotFound
from shard.stopping import FinishReason
from tests.engine_helpers import BlockPool, make_engine, request, steps_to_completion


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama)


def _prompts(engine):
    texts = ["The quick brown fox", "Paris is the capital of", "Once upon a time there was a small",
             "café", "def add(a, b):", "The lazy dog jumps over the quick brown fox again and",
             "emoji 🙂 are", "Berlin"]
    return [engine.tokenizer.encode(t).ids for t in texts]


def _run_alone(engine, pool, rid, prompt, max_new):
    blocks = pool.take(len(prompt) + max_new, 4)
    out = engine.prefill(rid, [request(rid, prompt, blocks, max_new_tokens=max_new, ignore_eos=True)])
    tokens = [out.generations[0].tokens.ids[0]]
    while out.batch is not None:
        out = engine.decode([out.batch.id])
        tokens.append(out.generations[0].tokens.ids[0])
    pool.give(blocks)
    return tokens


def test_greedy_tokens_same_alone_and_in_a_changing_batch(engine):
    pool = BlockPool(512)
    prompts = _prompts(engine)
    max_new = [12, 5, 9, 16, 3, 7, 11, 6]
    alone = [_run_alone(engine, pool, 100 + i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))]

    # requests join two at a time every other step and finish at different steps
    got = {i: [] for i in range(8)}
    blocks = {}
    running = None
    pending = list(range(8))
    step = 0
    while pending or running is not None:
        new_batch = None
        if pending and step % 2 == 0:
            joining, pending = pending[:2], pending[2:]
            reqs = []
            for i in joining:
                blocks[i] = pool.take(len(prompts[i]) + max_new[i], 4)
                reqs.append(request(i, prompts[i], blocks[i], max_new_tokens=max_new[i],
                                    ignore_eos=True))
            out = engine.prefill(1000 + step, reqs)
            for g in out.generations:
                got[g.request_id].append(g.tokens.ids[0])
            new_batch = _filtered(engine, out, pool, blocks)
        ids = [b.id for b in (running, new_batch) if b is not None]
        running = None
        if ids:
            out = engine.decode(ids)
            for g in out.generations:
                got[g.request_id].append(g.tokens.ids[0])
            running = _filtered(engine, out, pool, blocks)
        step += 1
    assert [got[i] for i in range(8)] == alone
    assert sorted(pool.free) == list(range(1, 512)), "every block came back"
    assert engine.batches == {}


def _filtered(engine, out, pool, blocks):
    finished = {g.request_id for g in out.generations if g.generated_text is not None}
    for rid in finished:
        pool.give(blocks.pop(rid))
    if out.batch is None:
        return None
    alive = [r for r in out.batch.request_ids if r not in finished]
    if not alive:
        engine.clear(out.batch.id)
        return None
    return engine.filter(out.batch.id, alive)


def test_stream_pieces_concatenate_to_final_text_and_logprobs_are_returned(engine):
    prompt = engine.tokenizer.encode("café naïve").ids
    out = engine.prefill(1, [request(1, prompt, list(range(1, 20)), max_new_tokens=20,
                                     ignore_eos=True, prefill_logprobs=True, top_n_tokens=3)])
    g = out.generations[0]
    assert g.prompt.tokens.ids == prompt
    assert len(g.prompt.tokens.logprobs) == len(prompt)
    assert all(lp <= 0 for lp in g.prompt.tokens.logprobs[1:])
    assert len(g.top_tokens[0].ids) == 3
    pieces = [g.tokens.texts[0]]
    while out.batch is not None:
        out = engine.decode([out.batch.id])
        g = out.generations[0]
        assert g.tokens.logprobs[0] <= 0
        pieces.append(g.tokens.texts[0])
    assert g.generated_text.generated_tokens == 20
    assert "".join(pieces) == g.generated_text.text


def test_unknown_batch_is_an_error_and_bad_blocks_refuse_their_request_alone(engine):
    with pytest.raises(BatchNotFound):
        engine.decode([424242])
    out = engine.prefill(7, [request(7, [5, 6, 7], [1], max_new_tokens=10)])
    assert out.batch is None and out.generations == []
    assert [(rid, "KV slots" in why) for rid, why in out.rejected] == [(7, True)]
    for stray in (-1, engine.runner.num_blocks):
        out = engine.prefill(8, [request(8, [5, 6, 7], [1, stray, 2], max_new_tokens=6)])
        assert [rid for rid, _ in out.rejected] == [8] and "outside the pool" in out.rejected[0][1]


def test_token_ids_past_the_vocabulary_and_too_many_top_tokens_refuse_their_request(engine):
    vocab = engine.vocab_size
    out = engine.prefill(9, [request(9, [5, vocab], [1, 2], max_new_tokens=3)])
    assert [rid for rid, _ in out.rejected] == [9] and "vocabulary" in out.rejected[0][1]
    greedy = request(10, [5, 6], [1, 2], max_new_tokens=3)
    greedy.params.top_n_tokens = vocab + 1
    out = engine.prefill(10, [greedy])
    assert [rid for rid, _ in out.rejected] == [10] and "top tokens" in out.rejected[0][1]
    biased = request(11, [5, 6], [1, 2], max_new_tokens=3)
    biased.params.logit_bias = {3: 1.0, vocab: -100.0}
    out = engine.prefill(11, [biased])
    assert [rid for rid, _ in out.rejected] == [11] and "biases a token id" in out.rejected[0][1]


def test_a_request_reaching_past_the_models_positions_is_refused_alone(engine):
    """The rotary table ends at max_position_embeddings (512 for the tiny model): past it a
    CPU step raised for the whole batch, and on CUDA the index is a device-side assert."""
    pool = BlockPool(512)
    longest = engine.max_positions
    too_long = request(1, [5] * 500, pool.take(longest + 4, 4), max_new_tokens=longest - 498)
    fits = request(2, [5] * 500, pool.take(longest + 4, 4), max_new_tokens=longest - 499)
    out = engine.prefill(1, [too_long, fits])
    assert [rid for rid, _ in out.rejected] == [1] and "past the model's 512" in out.rejected[0][1]
    assert [g.request_id for g in out.generations] == [2]
    engine.clear()


def test_a_request_the_shard_refuses_leaves_the_others_and_the_riding_batch_going(engine):
    """A grammar this vocabulary cannot compile, beside good requests and a running batch riding
    in the same forward: only that request is refused, and every other token is the same."""
    pool = BlockPool(512)
    prompts = _prompts(engine)
    alone = [_run_alone(engine, pool, 400 + i, p, 12) for i, p in enumerate(prompts[:3])]
    blocks = [pool.take(len(p) + 12, 4) for p in prompts[:3]]
    out = engine.prefill(50, [request(0, prompts[0], blocks[0], max_new_tokens=12,
                                      ignore_eos=True)])
    got = {0: [out.generations[0].tokens.ids[0]]}
    bad = request(5, prompts[1], pool.take(len(prompts[1]) + 12, 4), max_new_tokens=12)
    bad.grammar = ("regex", "(unclosed")
    new = [request(i, prompts[i], blocks[i], max_new_tokens=12, ignore_eos=True) for i in (1, 2)]
    out = engine.prefill(51, [new[0], bad, new[1]], cached_batch_id=out.batch.id)
    assert [rid for rid, _ in out.rejected] == [5] and "grammar" in out.rejected[0][1]
    assert out.batch.request_ids == [0, 1, 2]
    for g in out.generations:
        got.setdefault(g.request_id, []).append(g.tokens.ids[0])
    while out.batch is not None:
        out = engine.decode([out.batch.id])
        for g in out.generations:
            got[g.request_id].append(g.tokens.ids[0])
    # rows that finished ride on until the batch ends (the router filters them): first 12 count
    assert [got[i][:12] for i in range(3)] == alone
    # all refused, with a running batch: it still takes its step
    out = engine.prefill(60, [request(0, prompts[0], blocks[0], max_new_tokens=3)])
    out = engine.prefill(61, [bad], cached_batch_id=out.batch.id)
    assert [rid for rid, _ in out.rejected] == [5] and out.batch.request_ids == [0]
    assert [g.request_id for g in out.generations] == [0]
    engine.clear()


def test_same_seed_same_sample(engine):
    prompt = engine.tokenizer.encode("Once upon a time").ids

    def sampled(seed):
        return _tokens(engine, request(3, prompt, list(range(1, 10)), max_new_tokens=10,
                                       ignore_eos=True, do_sample=True, seed=seed,
                                       temperature=1.5))

    assert sampled(11) == sampled(11)
    assert sampled(11) != sampled(12)


def _tokens(engine, req):
    out = engine.prefill(9, [req])
    tokens = [out.generations[0].tokens.ids[0]]
    while out.batch is not None:
        out = engine.decode([out.batch.id])
        tokens.append(out.generations[0].tokens.ids[0])
    return tokens


def test_a_prompt_prefilled_in_chunks_answers_like_one_prefill(engine):
    prompt = engine.tokenizer.encode("The lazy dog jumps over the quick brown fox again and "
                                     "again until the sun goes down").ids
    whole = _tokens(engine, request(1, prompt, list(range(1, 30)), max_new_tokens=8,
                                    ignore_eos=True))
    blocks = list(range(40, 70))
    for start in range(0, len(prompt) - 5, 5):
        chunk = request(2, prompt, blocks, max_new_tokens=8, ignore_eos=True)
        chunk.cache_len, chunk.chunk_len = start, 5
        out = engine.prefill(50 + start, [chunk])
        assert out.generations == [] and out.batch is None, "a partial chunk yields nothing"
    last = request(2, prompt, blocks, max_new_tokens=8, ignore_eos=True)
    last.cache_len = start + 5
    assert _tokens(engine, last) == whole
    with pytest.raises(ValueError, match="alone"):
        partial = request(3, prompt, blocks, max_new_tokens=8)
        partial.chunk_len = 3
        engine.prefill(99, [partial, request(4, prompt, list(range(80, 100)), max_new_tokens=2)])


def test_contexts_of_very_different_lengths_decode_in_groups_like_alone(engine, monkeypatch):
    """A long context no longer pads every short one: rows are attended in length groups, and the
    tokens are those each request gets alone."""
    from shard import attention_inputs

    monkeypatch.setattr(attention_inputs, "GROUP_SLACK_TOKENS", 2)  # groups even at these lengths
    monkeypatch.setattr(engine.runner, "paged_kernel", False)  # groups are the PyTorch path's
    pool = BlockPool(512)
    short, text = engine.tokenizer.encode("Berlin").ids, _prompts(engine)[5]
    medium, long = (text * 4)[:12], (text * 4)[:40]
    prompts, max_new = [short, long, medium, short + [5]], [6, 6, 6, 6]
    assert len(attention_inputs.group_by_context([len(p) + 1 for p in prompts])) >= 3
    alone = [_run_alone(engine, pool, 200 + i, p, n) for i, (p, n) in enumerate(zip(prompts, max_new))]
    blocks = [pool.take(len(p) + n, 4) for p, n in zip(prompts, max_new)]
    out = engine.prefill(7, [request(i, p, b, max_new_tokens=n, ignore_eos=True)
                             for i, (p, b, n) in enumerate(zip(prompts, blocks, max_new))])
    got = {g.request_id: [g.tokens.ids[0]] for g in out.generations}
    while out.batch is not None:
        out = engine.decode([out.batch.id])
        for g in out.generations:
            got[g.request_id].append(g.tokens.ids[0])
    assert [got[i] for i in range(4)] == alone


def test_group_by_context_bounds_the_padding():
    from shard.attention_inputs import GROUP_SLACK_TOKENS, group_by_context

    assert group_by_context([100, 120, 90]) == [[2, 0, 1]]
    assert group_by_context([2048, 130, 140, 2050]) == [[1, 2], [0, 3]]
    lengths = [10, 10 + GROUP_SLACK_TOKENS, 11 + GROUP_SLACK_TOKENS]
    assert group_by_context(lengths) == [[0, 1], [2]]
    assert group_by_context([]) == []


def test_a_running_batch_rides_in_the_chunks_forward_and_answers_like_alone(engine):
    """TGI's cached_batch: each chunk's forward also decodes the running batch; the long prompt
    joins that batch after its last chunk; every token is the one each request gets alone."""
    pool = BlockPool(512)
    prompts = _prompts(engine)
    long = engine.tokenizer.encode("The lazy dog jumps over the quick brown fox again and "
                                   "again until the sun goes down").ids
    alone = [_run_alone(engine, pool, 300 + i, p, 40) for i, p in enumerate(prompts[:2])]
    long_alone = _run_alone(engine, pool, 310, long, 6)

    blocks = {i: pool.take(len(prompts[i]) + 40, 4) for i in range(2)}
    out = engine.prefill(20, [request(i, prompts[i], blocks[i], max_new_tokens=40, ignore_eos=True)
                              for i in range(2)])
    got = {g.request_id: [g.tokens.ids[0]] for g in out.generations}
    running = out.batch
    long_blocks = pool.take(len(long) + 6, 4)
    assert len(long) < 5 * 30, "the running requests outlast the chunks"
    for start in range(0, len(long) - 5, 5):
        chunk = request(9, long, long_blocks, max_new_tokens=6, ignore_eos=True)
        chunk.cache_len, chunk.chunk_len = start, 5
        out = engine.prefill(40 + start, [chunk], cached_batch_id=running.id)
        assert [g.request_id for g in out.generations] == [0, 1], "only the running rows yield"
        assert out.batch.id == running.id and out.batch.request_ids == [0, 1]
        for g in out.generations:
            got[g.request_id].append(g.tokens.ids[0])
        running = out.batch
    last = request(9, long, long_blocks, max_new_tokens=6, ignore_eos=True)
    last.cache_len = start + 5
    out = engine.prefill(90, [last], cached_batch_id=running.id)
    assert out.batch.id == running.id and out.batch.request_ids == [0, 1, 9]
    got[9] = []
    while True:
        for g in out.generations:
            got[g.request_id].append(g.tokens.ids[0])
        if out.batch is None:
            break
        finished = {g.request_id for g in out.generations if g.generated_text is not None}
        alive = [r for r in out.batch.request_ids if r not in finished]
        if not alive:
            engine.clear(out.batch.id)
            break
        out = engine.decode([engine.filter(out.batch.id, alive).id])
    assert [got[0], got[1], got[9]] == alone + [long_alone]
    with pytest.raises(BatchNotFound):
        engine.prefill(91, [request(5, prompts[0], pool.take(20, 4))], cached_batch_id=12345)


def _steps_with(engine, batch_id, max_steps, *, streamed=False):
    """Three requests of 5, 12 and 9 tokens decoded with calls of up to max_steps steps, finished
    ones filtered between calls as the router does: each request's tokens (ids, scores, texts,
    top tokens), the steps each call took and, `streamed`, how many steps each call handed to
    on_step before its result (whose tokens are then its last step's)."""
    pool = BlockPool(512)
    prompts = _prompts(engine)[:3]
    requests = [request(batch_id + i, p, pool.take(len(p) + 12, 4), max_new_tokens=n,
                        ignore_eos=True, top_n_tokens=2)
                for i, (p, n) in enumerate(zip(prompts, (5, 12, 9)))]
    got = {r.id: [] for r in requests}

    def record(out):
        for g in out.generations:
            got[g.request_id] += list(zip(g.tokens.ids, g.tokens.logprobs, g.tokens.texts,
                                          [tuple(t.ids) for t in g.top_tokens]))

    def on_step(step):
        assert all(len(g.tokens.ids) == 1 for g in step.generations), "one step's tokens"
        assert not any(g.generated_text is not None for g in step.generations)
        handed[-1] += 1
        record(step)

    out = engine.prefill(batch_id, requests)
    calls, handed = [], []
    while True:
        record(out)
        finished = {g.request_id for g in out.generations if g.generated_text is not None}
        if out.batch is None:
            break
        alive = [r for r in out.batch.request_ids if r not in finished]
        if len(alive) < len(out.batch.request_ids):
            engine.filter(out.batch.id, alive)
        handed.append(0)
        out = engine.decode([out.batch.id], max_steps, on_step if streamed else None)
        calls.append(out.steps)
    return list(got.values()), calls, handed


def test_several_decode_steps_in_one_call_are_the_steps_one_call_each(engine, tiny_llama):
    """max_steps: the same tokens as a call a step; a call ends after the step in which a request
    finished (5 tokens: the prefill's and 4 steps), so the others go on in the next call."""
    one, one_calls, _ = _steps_with(engine, 300, 1)
    four, four_calls, _ = _steps_with(engine, 400, 4)
    assert four == one and [len(t) for t in one] == [5, 12, 9]
    assert one_calls == [1] * 11 and four_calls == [4, 4, 3]
    streamed, stream_calls, handed = _steps_with(engine, 600, 4, streamed=True)
    assert streamed == one and stream_calls == [4, 4, 3] and handed == [3, 3, 2]
    speculating = make_engine(tiny_llama, speculate=2)
    _, calls, _ = _steps_with(speculating, 500, 4)
    assert set(calls) == {1}, "a speculating shard takes a step a call"


def test_min_new_tokens_bans_the_end_until_then_unless_a_grammar_can_only_end(engine):
    pool = BlockPool(512)
    prompt = _prompts(engine)[0]
    (eos,) = sorted(engine.loaded.eos_token_ids)[:1]
    # the end all but forced from the first token on (logit_bias): banned for the first three
    eager = request(1, prompt, pool.take(len(prompt) + 10, 4), max_new_tokens=10,
                    min_new_tokens=3, logit_bias={eos: 100.0})
    results = list(steps_to_completion(engine, [eager]))
    ids = [i for out in results for g in out.generations for i in g.tokens.ids]
    assert eos not in ids[:3] and ids[3] == eos and len(ids) == 4
    assert results[-1].generations[0].generated_text.finish_reason == FinishReason.EOS_TOKEN
    # a grammar that is done after "a" allows only the end: it ends, min_new_tokens or not
    done = request(2, prompt, pool.take(len(prompt) + 10, 4), max_new_tokens=10,
                   min_new_tokens=5)
    done.grammar = ("regex", "a")
    results = list(steps_to_completion(engine, [done], batch_id=2))
    final = results[-1].generations[0].generated_text
    assert final.text == "a" and final.finish_reason == FinishReason.EOS_TOKEN
    assert final.generated_tokens == 2


def test_a_grammar_the_lexer_gives_up_on_ends_its_request_with_an_error(engine):
    """llguidance finds a{1000000} too complex only once it meets it: its mask then allows
    nothing but the end, which looked like a complete answer. The request now ends with an
    error, and the request beside it goes on."""
    pool = BlockPool(512)
    prompts = _prompts(engine)
    broken = request(1, prompts[0], pool.take(len(prompts[0]) + 6, 4), max_new_tokens=6)
    broken.grammar = ("regex", "a{1000000}")
    fine = request(2, prompts[1], pool.take(len(prompts[1]) + 6, 4), max_new_tokens=6,
                   ignore_eos=True)
    generations = [g for out in steps_to_completion(engine, [broken, fine])
                   for g in out.generations]
    failed = [g for g in generations if g.request_id == 1 and g.error is not None]
    assert len(failed) == 1 and "the grammar could not go on" in failed[0].error
    assert failed[0].generated_text is not None  # ended in the shard's books too
    assert sum(len(g.tokens.ids) for g in generations if g.request_id == 2) == 6
