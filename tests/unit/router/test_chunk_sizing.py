"""Chunks of a long prompt are sized so each stalls the running streams by about one decode step."""
from router.chunk_sizing import MIN_CHUNK_TOKENS, StepCosts, chunk_tokens


def test_nothing_decoding_takes_the_whole_budget():
    costs = StepCosts(decode_s=0.1, prefill_s_per_token=0.01)
    assert chunk_tokens(5000, 512, decoding=False, costs=costs) == 512
    assert chunk_tokens(100, 512, decoding=False, costs=costs) == 100


def test_without_measurements_the_budget_applies():
    assert chunk_tokens(5000, 512, decoding=True, costs=StepCosts()) == 512
    assert chunk_tokens(5000, 512, decoding=True, costs=StepCosts(decode_s=0.1)) == 512


def test_chunk_costs_about_one_decode_step():
    costs = StepCosts(decode_s=0.12, prefill_s_per_token=0.004)
    assert chunk_tokens(5000, 512, decoding=True, costs=costs) == 30
    # a faster machine or a bigger running batch affords bigger chunks, up to the budget
    assert chunk_tokens(5000, 512, decoding=True,
                        costs=StepCosts(decode_s=1.0, prefill_s_per_token=0.001)) == 512
    assert chunk_tokens(20, 512, decoding=True, costs=costs) == 20


def test_chunks_never_shrink_below_the_minimum():
    costs = StepCosts(decode_s=0.01, prefill_s_per_token=0.01)
    assert chunk_tokens(5000, 512, decoding=True, costs=costs) == MIN_CHUNK_TOKENS


def test_costs_are_moving_averages():
    costs = StepCosts()
    costs.observe_decode(0.1)
    assert costs.decode_s == 0.1
    costs.observe_decode(0.2)
    assert 0.1 < costs.decode_s < 0.2
    costs.observe_prefill(1.0, 100)
    assert costs.prefill_s_per_token == 0.01
    costs.observe_prefill(1.0, 0)  # a step that computed nothing (all cached) says nothing
    assert costs.prefill_s_per_token == 0.01
