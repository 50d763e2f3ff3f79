"""Chunks of a long prompt are sized so each stalls the running streams by a share of a step."""
from router.scheduler.chunk_sizing import (FIRST_CHUNK_TOKENS, MIN_CHUNK_TOKENS, MIN_STALL_RATIO,
                                           RECENT_DECODE_S, STALL_RATIO, DecodeCost,
                                           chunk_tokens, stall_ratio)


def test_nothing_decoding_takes_the_whole_budget():
    assert chunk_tokens(5000, 512, decode_s=None, chunk_s_per_token=0.01) == 512
    assert chunk_tokens(5000, 512, decode_s=None, chunk_s_per_token=None) == 512
    assert chunk_tokens(100, 512, decode_s=None, chunk_s_per_token=None) == 100


def test_the_first_chunk_beside_decoding_streams_is_a_small_probe():
    assert chunk_tokens(5000, 512, decode_s=0.1, chunk_s_per_token=None) == FIRST_CHUNK_TOKENS
    assert chunk_tokens(5000, 16, decode_s=0.1, chunk_s_per_token=None) == 16
    assert chunk_tokens(10, 512, decode_s=0.1, chunk_s_per_token=None) == 10


def test_later_chunks_cost_their_share_of_a_decode_step():
    assert chunk_tokens(5000, 512, decode_s=0.12, chunk_s_per_token=0.004, ratio=1.0) == 30
    assert chunk_tokens(5000, 512, decode_s=0.24, chunk_s_per_token=0.004) == 30  # half a step
    # a faster machine or a bigger running batch affords bigger chunks, up to the budget
    assert chunk_tokens(5000, 512, decode_s=2.0, chunk_s_per_token=0.001) == 512
    assert chunk_tokens(20, 512, decode_s=0.24, chunk_s_per_token=0.004) == 20


def test_the_stall_ratio_is_half_a_stream_s_share_with_a_floor():
    assert stall_ratio(0) == stall_ratio(1) == STALL_RATIO == 0.5
    assert stall_ratio(2) == STALL_RATIO / 2 == MIN_STALL_RATIO
    assert stall_ratio(64) == MIN_STALL_RATIO
    # a smaller share makes smaller chunks
    assert chunk_tokens(5000, 512, decode_s=0.48, chunk_s_per_token=0.004,
                        ratio=stall_ratio(2)) == 30


def test_chunks_never_shrink_below_the_minimum():
    assert chunk_tokens(5000, 512, decode_s=0.01, chunk_s_per_token=0.01) == MIN_CHUNK_TOKENS


def test_decode_cost_is_a_moving_average():
    cost = DecodeCost()
    cost.observe(0.1)
    assert cost.seconds == 0.1
    cost.observe(0.2)
    assert 0.1 < cost.seconds < 0.2


def test_a_chunk_right_after_decoding_stopped_is_sized_as_if_it_had_not():
    """Clients sending requests back to back leave gaps of milliseconds: a budget-sized chunk
    started in one would make their next request wait a second or so."""
    cost = DecodeCost()
    assert cost.for_chunk(False) is None and cost.for_chunk(True) is None  # nothing measured
    cost.observe(0.05, now=100.0)
    assert cost.for_chunk(True, now=500.0) == 0.05
    assert cost.for_chunk(False, now=100.0 + RECENT_DECODE_S / 2) == 0.05
    assert cost.for_chunk(False, now=100.0 + RECENT_DECODE_S * 2) is None
