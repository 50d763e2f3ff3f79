"""Each warper and penalty on hand-made logits, greedy rows beside sampling rows, seeds."""
import math

import torch

from shard.sampling import SamplingBatch, SamplingParams, sample

CPU = torch.device("cpu")


def _batch(*params):
    return SamplingBatch.from_params(list(params), CPU)


def _allowed(logits, params, draws=200):
    """Tokens a sampling row can produce, seen over many seeds."""
    seen = set()
    for seed in range(draws):
        p = SamplingParams(**{**params, "do_sample": True, "seed": seed})
        seen.add(sample(logits, _batch(p)).next_ids.item())
    return seen


LOGITS = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))


def test_greedy_takes_argmax_and_reports_its_logprob():
    out = sample(LOGITS, _batch(SamplingParams()))
    assert out.next_ids.tolist() == [0]
    assert math.isclose(out.logprobs.item(), math.log(0.5), rel_tol=1e-5)


def test_greedy_rows_report_what_the_full_distribution_says():
    """A greedy batch picks without the vocabulary's log-probabilities (C on the CPU); computed on
    demand, they agree with the picks, as a batch with a sampling row computes them up front."""
    torch.manual_seed(0)
    logits = torch.randn(4, 1000) * 3
    greedy = sample(logits, _batch(*[SamplingParams()] * 4))
    distribution = greedy.log_distribution()
    torch.testing.assert_close(distribution, torch.log_softmax(logits, dim=-1))
    assert torch.equal(greedy.next_ids, logits.argmax(dim=-1))
    torch.testing.assert_close(greedy.logprobs, distribution.gather(
        1, greedy.next_ids.unsqueeze(1)).squeeze(1), rtol=0, atol=1e-5)
    mixed = sample(logits, _batch(*[SamplingParams()] * 3, SamplingParams(do_sample=True, seed=1)))
    assert torch.equal(mixed.next_ids[:3], greedy.next_ids[:3])
    torch.testing.assert_close(mixed.logprobs[:3], greedy.logprobs[:3], rtol=0, atol=1e-5)


def test_top_k_keeps_k_tokens():
    assert _allowed(LOGITS, {"top_k": 2}) == {0, 1}


def test_top_p_keeps_smallest_set_reaching_p():
    assert _allowed(LOGITS, {"top_p": 0.6}) == {0, 1}
    assert _allowed(LOGITS, {"top_p": 0.4}) == {0}


def test_typical_p_drops_the_least_typical_tokens():
    allowed = _allowed(LOGITS, {"typical_p": 0.5})
    assert allowed and allowed < {0, 1, 2, 3, 4}
    assert 4 not in allowed


def test_min_p_drops_tokens_far_below_the_top():
    assert _allowed(LOGITS, {"min_p": 0.35}) == {0, 1}


def test_temperature_sharpens():
    cold = SamplingParams(do_sample=True, temperature=0.01, seed=3)
    assert all(sample(LOGITS, _batch(SamplingParams(**{**_as_dict(cold), "seed": s}))).next_ids.item()
               == 0 for s in range(50))


def _as_dict(p):
    return {k: getattr(p, k) for k in p.__slots__}


def test_same_seed_same_draws_and_rows_are_independent():
    logits = torch.zeros(2, 1000)
    a = _batch(SamplingParams(do_sample=True, seed=7), SamplingParams())
    b = _batch(SamplingParams(do_sample=True, seed=7), SamplingParams())
    draws_a = [sample(logits, a, positions=torch.tensor([n, n])).next_ids.tolist()
               for n in range(5)]
    draws_b = [sample(logits, b, positions=torch.tensor([n, n])).next_ids.tolist()
               for n in range(5)]
    assert draws_a == draws_b
    assert all(row[1] == 0 for row in draws_a), "the greedy row stays greedy"
    assert len({row[0] for row in draws_a}) > 1, "the draw changes with the position"


def test_a_seed_draws_the_same_token_at_a_position_in_any_batch():
    """The draw is keyed by seed and position alone: not by the row, the batch's other rows or
    how many draws came before."""
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    alone = [sample(logits, _batch(SamplingParams(do_sample=True, seed=11)),
                    positions=torch.tensor([n])).next_ids.item() for n in range(20, 30)]
    others = [SamplingParams(do_sample=True, seed=s, temperature=0.7) for s in range(3)]
    mixed = _batch(SamplingParams(), others[0], SamplingParams(do_sample=True, seed=11), *others[1:])
    batched = [sample(logits.expand(5, -1), mixed, positions=torch.tensor([0, 3, n, 5, n])
                      ).next_ids[2].item() for n in range(20, 30)]
    assert batched == alone
    assert len(set(alone)) > 5


def test_draws_follow_the_distribution():
    """Frequencies over many seeds match the probabilities, and the noise is Exp(1) with
    neighbouring token ids uncorrelated."""
    from shard.noise_hash import seed_key
    from shard.sampling_noise import exponentials

    rows = 20_000
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    batch = _batch(*[SamplingParams(do_sample=True, seed=s) for s in range(rows)])
    drawn = sample(torch.log(probs).expand(rows, -1), batch,
                   positions=torch.full((rows,), 9)).next_ids
    frequencies = torch.bincount(drawn, minlength=5) / rows
    assert torch.allclose(frequencies, probs, atol=4 * (0.25 / rows) ** 0.5)
    noise = exponentials(torch.tensor([seed_key(s) for s in range(64)]),
                         torch.arange(64), 4096).double()
    assert abs(noise.mean().item() - 1) < 0.01 and abs(noise.var().item() - 1) < 0.03
    neighbours = torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))
    assert abs(neighbours[0, 1].item()) < 0.01


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 1.5]])
    out = sample(logits, _batch(SamplingParams(repetition_penalty=2.0)), [([0, 1], [])])
    assert out.next_ids.item() == 2  # 2.0 / 2 = 1.0 < 1.5
    scores = out.logprobs.item()
    assert math.isclose(scores, torch.log_softmax(torch.tensor([1.0, -2.0, 1.5]), 0)[2].item(),
                        rel_tol=1e-5)


def test_frequency_and_presence_penalties_count_output_tokens():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    freq = sample(logits, _batch(SamplingParams(frequency_penalty=0.4)), [([], [0, 0])])
    assert freq.next_ids.item() == 1  # 3.0 - 2 * 0.4 = 2.2 < 2.5
    pres = sample(logits, _batch(SamplingParams(presence_penalty=0.4)), [([], [0, 0])])
    assert pres.next_ids.item() == 0  # 3.0 - 0.4 = 2.6 > 2.5


def test_top_n_tokens_are_the_most_likely():
    out = sample(LOGITS, _batch(SamplingParams(top_n_tokens=3)))
    assert out.top_ids.tolist() == [[0, 1, 2]]


def test_select_and_concatenate_keep_rows_aligned():
    batch = _batch(SamplingParams(top_k=1, do_sample=True, seed=1), SamplingParams(),
                   SamplingParams(temperature=0.5, do_sample=True, seed=2))
    picked = batch.select([2, 0])
    assert picked.temperature.flatten().tolist() == [0.5, 1.0]
    merged = SamplingBatch.concatenate([picked, _batch(SamplingParams())])
    assert merged.do_sample.tolist() == [True, True, False]
    assert merged.seed_keys[1] == batch.seed_keys[0]


def test_watermark_is_detected_in_watermarked_text_only():
    from shard.watermark import z_score

    vocab = 1000
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, vocab, generator=generator) * 0.5

    def generate(watermark):
        history = [17]
        batch = _batch(SamplingParams(do_sample=True, seed=5, watermark=watermark))
        for n in range(200):
            history.append(sample(logits, batch, [(history[:1], history[1:])],
                                  positions=torch.tensor([n])).next_ids.item())
        return history[1:]

    assert z_score(generate(True), vocab, 17) > 4
    assert abs(z_score(generate(False), vocab, 17)) < 3


def test_a_vanishing_temperature_is_greedy_with_finite_logprobs():
    """1e-45 (a float32 subnormal) divided into the logits themselves overflows them to +-inf
    and every probability to NaN: the token came out as id 0 with a null logprob."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 2.9, float("-inf")]])
    for temperature in (1e-45, 1e-30, 1e-6):
        for seed in range(5):
            out = sample(logits, _batch(SamplingParams(do_sample=True, temperature=temperature,
                                                       seed=seed, top_n_tokens=2)))
            assert out.next_ids.item() == 1, temperature
            assert out.logprobs.item() == 0.0  # all the mass on the largest logit
            assert torch.isfinite(out.top_logprobs[:, 0]).all()


def test_a_vanishing_repetition_penalty_leaves_a_distribution():
    logits = torch.tensor([[2.0, -1.0, 1.5, float("-inf")]])
    out = sample(logits, _batch(SamplingParams(repetition_penalty=1e-40, top_n_tokens=3)),
                 [([2], [])])
    assert out.next_ids.item() == 2  # 1.5 / 1e-40 passes float32: the largest float
    assert math.isfinite(out.logprobs.item())
    assert torch.isfinite(out.top_logprobs).all()
    assert torch.isneginf(out.log_distribution()[0, 3])  # a masked token stays masked


def test_logit_bias_is_added_before_anything_else_on_its_own_rows():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    kept = logits.clone()
    out = sample(logits, _batch(SamplingParams(logit_bias={0: -100.0, 2: 1.5}),
                                SamplingParams()))
    assert out.next_ids.tolist() == [2, 0]  # 0 + 1.5 beats 1.0; the second row is untouched
    assert torch.equal(logits, kept), "the logits are not changed in place"
    expected = torch.log_softmax(torch.tensor([-98.0, 1.0, 1.5]), 0)[2].item()
    assert math.isclose(out.logprobs[0].item(), expected, rel_tol=1e-5)
    # a penalty sees the biased logit: 1.5 / 2 = 0.75 < 1.0
    out = sample(logits[:1], _batch(SamplingParams(logit_bias={0: -100.0, 2: 1.5},
                                                   repetition_penalty=2.0)), [([2], [])])
    assert out.next_ids.tolist() == [1]
    assert set(_allowed(logits[:1], {"logit_bias": {1: -100.0, 2: -100.0}})) == {0}


def test_banned_ids_are_never_chosen():
    """(A grammar that allows only banned ids keeps them: tests/unit/shard/test_engine.py.)"""
    logits = torch.tensor([[3.0, 1.0, 0.5], [3.0, 1.0, 0.5]])
    kept = logits.clone()
    batch = _batch(SamplingParams(), SamplingParams(top_n_tokens=1))
    out = sample(logits, batch, banned=[frozenset({0}), frozenset()])
    assert out.next_ids.tolist() == [1, 0]  # the first skips its banned best; the second has none
    assert torch.isfinite(out.logprobs).all()
    assert torch.equal(logits, kept), "the caller's logits are not written"
    for seed in range(20):
        drawn = sample(logits[:1], _batch(SamplingParams(do_sample=True, seed=seed)),
                       banned=[frozenset({0, 2})])
        assert drawn.next_ids.item() == 1


def test_the_triton_draw_is_the_pytorch_forms(triton_sampling):
    """One launch a row on CUDA (interpreted here): the same noise, the same tokens, greedy rows
    kept, a vocabulary past one block of token ids."""
    from shard.noise_hash import seed_key
    from shard.sampling_noise import draw

    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(6, 2500) * 2, dim=-1)
    logprobs[3, 100:] = float("-inf")  # a row top-k left 100 tokens
    keys = torch.tensor([seed_key(s) for s in (0, 1, 2**63 + 5, 7, 7, 2**64 - 1)])
    positions = torch.tensor([0, 1, 2, 3, 4, 10**6])
    greedy = logprobs.argmax(dim=-1)
    for rows in (None, torch.tensor([1, 3, 4])):
        want = draw(logprobs, keys, positions, rows, greedy)
        got = triton_sampling.draw(logprobs, keys, positions, rows, greedy)
        assert torch.equal(got.cpu(), want)
    assert want[3] < 100 and want[0] == greedy[0] and not torch.equal(want, greedy)
