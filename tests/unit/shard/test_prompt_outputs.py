"""What a step returns beyond the next token: prompts given as vectors, the log-probabilities of
named token ids, the top tokens of prompt positions, and the final hidden states."""
import math

import pytest
import torch

from tests.engine_helpers import BlockPool, make_engine, request, run_to_completion


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama)


PROMPT = [5, 17, 42, 99, 3, 250, 7]


def _embeds_of(engine, ids):
    return engine.loaded.model.embed(torch.tensor(ids)).float()


def test_a_prompt_given_as_its_embeddings_generates_what_its_ids_do(engine):
    pool = BlockPool(512)
    by_ids = request(1, PROMPT, pool.take(len(PROMPT) + 8, 4), ignore_eos=True)
    by_embeds = request(2, [], pool.take(len(PROMPT) + 8, 4), ignore_eos=True)
    by_embeds.input_embeds = _embeds_of(engine, PROMPT)
    together = run_to_completion(engine, [by_ids, by_embeds])
    assert together[1] == together[2] and len(together[1]) == 8


def test_embeddings_of_the_wrong_width_or_not_finite_refuse_that_request_alone(engine):
    pool = BlockPool(512)
    wrong = request(1, [], pool.take(12, 4))
    wrong.input_embeds = torch.zeros(3, engine.hidden_size + 1)
    bad = request(2, [], pool.take(12, 4))
    bad.input_embeds = torch.full((3, engine.hidden_size), math.nan)
    fine = request(3, PROMPT, pool.take(len(PROMPT) + 8, 4))
    out = engine.prefill(1, [wrong, bad, fine])
    assert [rid for rid, _ in out.rejected] == [1, 2]
    assert "hidden size" in out.rejected[0][1] and "finite" in out.rejected[1][1]
    assert [g.request_id for g in out.generations] == [3]
    engine.clear()


def test_embeddings_past_float16s_range_refuse_their_request_in_a_float16_model(tiny_llama):
    half = make_engine(tiny_llama, dtype=torch.float16, num_blocks=64)
    pool = BlockPool(64)
    big = request(1, [], pool.take(12, 4))
    big.input_embeds = torch.full((3, half.hidden_size), 1e5)  # finite in float32
    out = half.prefill(1, [big, request(2, PROMPT, pool.take(len(PROMPT) + 8, 4))])
    assert [rid for rid, _ in out.rejected] == [1] and "finite in float16" in out.rejected[0][1]
    assert [g.request_id for g in out.generations] == [2]


def test_named_token_ids_get_their_log_probabilities_at_every_position(engine):
    pool = BlockPool(512)
    asked = [7, 42, 3]
    r = request(1, PROMPT, pool.take(len(PROMPT) + 3, 4), max_new_tokens=3, ignore_eos=True,
                prefill_logprobs=True, top_n_tokens=5)
    r.logprob_token_ids = asked
    r.prefill_top_n_tokens = 4
    out = engine.prefill(1, [r])
    g = out.generations[0]
    prompt = g.prompt
    assert len(prompt.token_ids_logprobs) == len(PROMPT) * len(asked)
    assert all(math.isnan(v) for v in prompt.token_ids_logprobs[:len(asked)])
    rows = [prompt.token_ids_logprobs[i * 3:(i + 1) * 3] for i in range(len(PROMPT))]
    for position in range(1, len(PROMPT)):
        top = prompt.top_tokens[position]
        assert len(top.ids) == 4 and top.logprobs == sorted(top.logprobs, reverse=True)
        # the prompt token's own log-probability, where it is one of the asked ids, agrees
        if PROMPT[position] in asked:
            own = rows[position][asked.index(PROMPT[position])]
            assert own == pytest.approx(prompt.tokens.logprobs[position], abs=1e-5)
        assert top.logprobs[0] >= max(rows[position])
    assert prompt.top_tokens[0].ids == []
    # generated positions: the drawn token's own log-probability is in the same distribution
    first = g.tokens.ids[0]
    r2 = request(2, PROMPT, pool.take(len(PROMPT) + 3, 4), max_new_tokens=3, ignore_eos=True)
    r2.logprob_token_ids = [first, 0]
    out2 = engine.prefill(2, [r2])
    g2 = out2.generations[0]
    assert g2.token_ids_logprobs[0] == pytest.approx(g2.tokens.logprobs[0], abs=1e-6)
    assert len(g2.token_ids_logprobs) == 2
    step = engine.decode([out2.batch.id])
    assert len(step.generations[0].token_ids_logprobs) == 2
    engine.clear()


def test_hidden_states_are_the_final_normed_vectors_transformers_computes(engine, tiny_llama):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama,
                                                                  dtype=torch.float32).eval()
    pool = BlockPool(512)
    r = request(1, PROMPT, pool.take(len(PROMPT) + 3, 4), max_new_tokens=3, ignore_eos=True)
    r.return_hidden_states = True
    out = engine.prefill(1, [r])
    g = out.generations[0]
    tokens = PROMPT + g.tokens.ids
    with torch.no_grad():
        expected = reference.model(torch.tensor([PROMPT])).last_hidden_state[0]
    assert g.hidden_states.shape == expected.shape
    assert (g.hidden_states - expected).abs().max().item() < 1e-4
    step = engine.decode([out.batch.id]).generations[0]
    with torch.no_grad():
        expected = reference.model(torch.tensor([tokens])).last_hidden_state[0, -1:]
    assert (step.hidden_states - expected).abs().max().item() < 1e-4
    engine.clear()


def _asking_all(rid, blocks, prompt):
    r = request(rid, prompt, blocks, max_new_tokens=3, ignore_eos=True, prefill_logprobs=True)
    r.logprob_token_ids, r.prefill_top_n_tokens, r.return_hidden_states = [7, 42], 3, True
    return r


def test_a_prompt_whose_every_position_is_asked_for_is_chunked_like_any_other(engine):
    """Its chunks' scores and hidden states are kept and joined: the answer is the whole prefill's,
    and a chunk of another prompt replaces what a cancelled one left."""
    pool = BlockPool(512)
    prompt = (PROMPT * 4)[:26]
    whole = engine.prefill(1, [_asking_all(1, pool.take(40, 4), prompt)]).generations[0]
    engine.clear()
    blocks = pool.take(40, 4)
    stale = _asking_all(3, pool.take(40, 4), prompt)
    stale.chunk_len = 5
    assert engine.prefill(2, [stale]).generations == []  # cancelled after its first chunk
    assert engine.prompt_so_far is not None
    plain = request(4, prompt, pool.take(40, 4), max_new_tokens=3)
    plain.chunk_len = 5
    engine.prefill(3, [plain])  # another long prompt's chunk: the cancelled one is let go
    assert engine.prompt_so_far is None
    engine.prefill(4, [stale])
    engine.clear()
    assert engine.prompt_so_far is None, "nor does a cleared cache keep it"
    for start in range(0, 24, 6):
        chunk = _asking_all(2, blocks, prompt)
        chunk.cache_len, chunk.chunk_len = start, 6
        assert engine.prefill(10 + start, [chunk]).generations == []
    last = _asking_all(2, blocks, prompt)
    last.cache_len = 24
    got = engine.prefill(50, [last]).generations[0]
    engine.clear()
    assert engine.prompt_so_far is None
    assert got.tokens.ids == whole.tokens.ids
    assert got.prompt.tokens.ids == whole.prompt.tokens.ids == prompt
    assert got.prompt.tokens.logprobs[1:] == pytest.approx(whole.prompt.tokens.logprobs[1:],
                                                           abs=1e-4)
    assert math.isnan(got.prompt.tokens.logprobs[0])
    assert [t.ids for t in got.prompt.top_tokens] == [t.ids for t in whole.prompt.top_tokens]
    assert len(got.prompt.token_ids_logprobs) == len(prompt) * 2
    assert got.prompt.token_ids_logprobs[2:] == pytest.approx(whole.prompt.token_ids_logprobs[2:],
                                                              abs=1e-4)
    assert got.hidden_states.shape == whole.hidden_states.shape
    assert torch.allclose(got.hidden_states, whole.hidden_states, atol=1e-4)


def test_hidden_states_alone_compute_the_last_positions_logits_only(engine, monkeypatch):
    """Vocabulary-wide logits for every position only where scores are asked: the same hidden
    states and tokens come back either way."""
    rows, logits = [], engine.runner.model.logits
    monkeypatch.setattr(engine.runner.model, "logits", lambda h: rows.append(len(h)) or logits(h))
    pool = BlockPool(512)
    answers = []
    for scored in (False, True):
        hidden = request(1, PROMPT, pool.take(len(PROMPT) + 3, 4), max_new_tokens=3,
                         ignore_eos=True, prefill_logprobs=scored)
        hidden.return_hidden_states = True
        plain = request(2, PROMPT[:5], pool.take(8, 4), max_new_tokens=3, ignore_eos=True)
        answers.append(engine.prefill(1, [hidden, plain]).generations)
        engine.clear()
    assert rows == [2, len(PROMPT) + 1]
    alone, with_scores = answers
    assert [g.tokens.ids for g in alone] == [g.tokens.ids for g in with_scores]
    assert torch.equal(alone[0].hidden_states, with_scores[0].hidden_states)
    assert alone[0].prompt is None and with_scores[0].prompt is not None
