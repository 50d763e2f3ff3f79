from shard.stopping import FinishReason, StopCriteria


def test_length_comes_first_even_on_eos():
    stop = StopCriteria(max_new_tokens=2, eos_token_ids=frozenset({9}))
    assert stop.check(1, "a") is None
    assert stop.check(9, "") is FinishReason.LENGTH


def test_eos_stops_unless_ignored_and_is_banned_before_min_new_tokens():
    assert StopCriteria(10, frozenset({9})).check(9, "") is FinishReason.EOS_TOKEN
    assert StopCriteria(10, frozenset({9}), ignore_eos=True).check(9, "") is None
    early = StopCriteria(10, frozenset({9, 4}), min_new_tokens=2)
    assert early.banned_ids() == {9, 4}  # the sampler keeps them out of the first two tokens
    assert early.check(1, "a") is None
    assert early.banned_ids() == {9, 4}
    # one that comes anyway was all a grammar allowed: the request ends
    assert early.check(9, "") is FinishReason.EOS_TOKEN
    later = StopCriteria(10, frozenset({9}), min_new_tokens=2)
    later.check(1, "a")
    later.check(2, "b")
    assert later.banned_ids() == frozenset()


def test_stop_sequence_across_tokens():
    stop = StopCriteria(100, frozenset(), stop_sequences=["\nUser:"])
    pieces = ["Hello", " there", "\nUs", "er", ":"]
    results = [stop.check(i, p) for i, p in enumerate(pieces)]
    assert results == [None, None, None, None, FinishReason.STOP_SEQUENCE]


def test_stop_sequence_inside_a_single_token_text_cuts_what_follows():
    stop = StopCriteria(100, frozenset(), stop_sequences=["END", "Dyz"])
    assert stop.check(1, "xENDyz") is FinishReason.STOP_SEQUENCE
    assert stop.excess_chars == 2, "the stop that ends first wins"


def test_stop_sequence_spanning_tokens_with_text_after_it():
    stop = StopCriteria(100, frozenset(), stop_sequences=["\n\n"])
    assert stop.check(1, "Hi\n") is None
    assert stop.check(2, "\nBye") is FinishReason.STOP_SEQUENCE
    assert stop.excess_chars == 3


def test_tail_stays_bounded():
    stop = StopCriteria(10_000, frozenset(), stop_sequences=["zz"])
    for i in range(5000):
        stop.check(i, "abc")
    assert len(stop.tail) < 40
