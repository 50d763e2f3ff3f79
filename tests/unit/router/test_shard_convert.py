"""The translation to and from the shard contract: each request and each generation on its own,
so one bad value fails its own request; and the real client's prepare/prefill behave as the
scheduler's fake (tests/fakes.py) does."""
import asyncio

import pytest

from proto import generate_pb2 as pb
from router.schemas import FinishReason, GenerateRequest, SamplingParams, StoppingParams
from router.shards import convert
from router.shards.client import ShardedClient, ShardError
from router.shards.step_types import CachedBatch, NewBatch, ShardRequest


def _shard_request(rid, *, seed=0, chunk_len=None):
    request = GenerateRequest(inputs="x", input_ids=[5, 6, 7], sampling=SamplingParams(seed=seed),
                              stopping=StoppingParams(max_new_tokens=3, stop_sequences=["."]),
                              grammar=("regex", "[a-z]+"))
    return ShardRequest(rid, request, blocks=[1, 2], cache_len=1, chunk_len=chunk_len)


def test_a_request_becomes_its_message_field_by_field():
    message = convert.request_message(_shard_request(7, seed=42, chunk_len=1))
    assert (message.id, list(message.input_ids), list(message.blocks)) == (7, [5, 6, 7], [1, 2])
    assert (message.cache_len, message.chunk_len) == (1, 1)
    assert message.parameters.seed == 42
    biased = _shard_request(10)
    biased.request.sampling.logit_bias = {5: -100.0, 17: 2.5}
    message_of_bias = convert.request_message(biased)
    assert dict(message_of_bias.parameters.logit_bias) == {5: -100.0, 17: 2.5}
    from shard.convert import sampling_params  # what the shard reads back
    assert sampling_params(message_of_bias.parameters, 0).logit_bias == {5: -100.0, 17: 2.5}
    assert not sampling_params(message_of_bias.parameters, 0).frequency_by_share
    biased.request.sampling.frequency_by_share = True  # TGI's frequency penalty
    assert sampling_params(convert.request_message(biased).parameters, 0).frequency_by_share
    assert message.parameters.grammar_type == pb.GRAMMAR_TYPE_REGEX
    assert message.parameters.grammar == "[a-z]+"
    assert list(message.stopping_parameters.stop_sequences) == ["."]
    assert not convert.request_message(_shard_request(8)).HasField("chunk_len")
    ebnf = _shard_request(9)
    ebnf.request.grammar = ("ebnf", 'root ::= "a"')
    message = convert.request_message(ebnf)
    assert message.parameters.grammar_type == pb.GRAMMAR_TYPE_EBNF
    assert message.parameters.grammar == 'root ::= "a"'


def test_a_value_the_wire_cannot_carry_rejects_its_request_alone():
    batch = NewBatch(3, [_shard_request(0), _shard_request(1, seed=-1), _shard_request(2)],
                     max_tokens=30, max_blocks=2)
    message, rejected = convert.batch_message(batch)
    assert [r.id for r in message.requests] == [0, 2] and message.size == 2
    assert [r.request_id for r in rejected] == [1]
    assert isinstance(rejected[0].error, ValueError) and rejected[0].reason.startswith("ValueError")


def _generation(rid, **fields):
    return pb.Generation(request_id=rid, tokens=pb.Tokens(ids=[4], logprobs=[float("-inf")],
                                                          texts=["a"], is_special=[False]),
                         **fields)


def test_a_generation_that_cannot_be_read_fails_its_request_alone():
    reply = pb.DecodeResponse(generations=[
        _generation(0), pb.Generation(request_id=1),  # no token at all
        _generation(2, generated_text=pb.GeneratedText(
            text="a", generated_tokens=1, finish_reason=pb.FINISH_REASON_STOP_SEQUENCE, seed=9))],
        batch=pb.CachedBatch(id=5, request_ids=[0, 1, 2], size=3, max_tokens=48),
        forward_ns=10, decode_ns=2)
    result = convert.step_result(reply, hidden_size=4)
    first, broken, last = result.generations
    assert first.events[0].token.logprob is None, "-inf has no JSON spelling"
    assert broken.events == [] and isinstance(broken.error, ValueError)
    assert last.events[0].final.finish_reason is FinishReason.STOP_SEQUENCE
    assert last.events[0].final.seed == 9
    assert result.batch == CachedBatch(5, [0, 1, 2], 48)
    assert (result.timings.forward_ns, result.timings.concat_ns) == (10, None)


def test_every_finish_reason_of_the_contract_has_a_router_name():
    named = {v for k, v in pb.FinishReason.items() if k != "FINISH_REASON_UNSPECIFIED"}
    assert named <= set(convert._FINISH), "a finish reason the router cannot read"


class _RecordingRank:
    """One rank's channel: answers Prefill and Decode, and records what it was sent."""

    def __init__(self):
        self.sent = []

    async def call(self, method, message, timeout=None, metadata=None):
        self.sent.append((method, message))
        if method == "Prefill":
            ids = [r.id for r in message.batch.requests]
            return pb.PrefillResponse(generations=[_generation(i) for i in ids],
                                      batch=pb.CachedBatch(id=message.batch.id, request_ids=ids))
        return pb.DecodeResponse(generations=[_generation(i) for b in message.batches
                                              for i in b.request_ids])


def test_the_client_leaves_out_the_requests_that_cannot_be_translated():
    client = ShardedClient([_RecordingRank()])
    batch = NewBatch(1, [_shard_request(0), _shard_request(1, seed=-1), _shard_request(2)], 10, 2)
    prepared, rejected = client.prepare(batch)
    assert prepared.request_ids == [0, 2]
    assert [r.id for r in prepared.message.requests] == [0, 2]
    assert [r.request_id for r in rejected] == [1]


async def test_the_client_prefills_the_prepared_batch_with_the_running_one_riding():
    rank = _RecordingRank()
    client = ShardedClient([rank])
    prepared, _ = client.prepare(NewBatch(1, [_shard_request(0), _shard_request(1, seed=-1)],
                                          10, 2))
    result = await client.prefill(prepared, CachedBatch(9, [4]))
    (method, message), = rank.sent
    assert method == "Prefill" and message.cached_batch.id == 9
    assert [r.id for r in message.batch.requests] == [0]
    assert result.batch.request_ids == [0] and result.rejected == []


def test_embeddings_named_ids_and_hidden_states_cross_the_wire():
    import numpy

    shard_request = _shard_request(3)
    request = shard_request.request
    request.input_ids, request.input_embeds, request.embeds_rows = [], b"\0" * 32, 2
    request.logprob_token_ids, request.prefill_top_n_tokens = [4, 9], 3
    request.return_hidden_states = True
    message = convert.request_message(shard_request)
    assert message.input_embeds == b"\0" * 32 and list(message.logprob_token_ids) == [4, 9]
    assert message.prefill_top_n_tokens == 3 and message.return_hidden_states
    hidden = numpy.arange(8, dtype="<f4")
    reply = pb.PrefillResponse(generations=[_generation(
        3, token_ids_logprobs=[-1.0, float("nan")],
        prefill_token_ids_logprobs=[float("nan"), float("nan"), -2.0, -3.0],
        prefill_top_tokens=[pb.Tokens(), pb.Tokens(ids=[4], logprobs=[-0.5], texts=["d"])],
        hidden_states=hidden.tobytes())])
    event, = convert.step_result(reply, hidden_size=4).generations[0].events
    assert event.token_ids_logprobs == [-1.0, None]
    assert event.prefill_token_ids_logprobs == [[None, None], [-2.0, -3.0]]
    assert event.prefill_top_tokens[0] == [] and event.prefill_top_tokens[1][0].id == 4
    assert event.hidden_states.dtype == numpy.float32
    assert event.hidden_states.tolist() == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    torn = pb.PrefillResponse(generations=[_generation(3, hidden_states=hidden[:6].tobytes())])
    assert isinstance(convert.step_result(torn, hidden_size=4).generations[0].error, ValueError)


def test_a_step_that_accepted_drafts_gives_one_event_per_token():
    import numpy

    hidden = numpy.arange(12, dtype="<f4")
    reply = pb.DecodeResponse(generations=[pb.Generation(
        request_id=4,
        tokens=pb.Tokens(ids=[7, 8, 9], logprobs=[-0.5, -0.25, -0.125], texts=["a", "b", "c"],
                         is_special=[False, False, True]),
        top_tokens=[pb.Tokens(ids=[7], logprobs=[-0.1], texts=["a"]),
                    pb.Tokens(ids=[8], logprobs=[-0.2], texts=["b"]),
                    pb.Tokens(ids=[9], logprobs=[-0.3], texts=["c"])],
        token_ids_logprobs=[-1.0, -2.0, -3.0, -4.0, -5.0, -6.0],
        hidden_states=hidden.tobytes(),
        generated_text=pb.GeneratedText(text="abc", generated_tokens=3,
                                        finish_reason=pb.FINISH_REASON_EOS_TOKEN))],
        draft_tokens=4, accepted_tokens=2)
    result = convert.step_result(reply, hidden_size=4)
    assert (result.draft_tokens, result.accepted_tokens) == (4, 2)
    events = result.generations[0].events
    assert [(e.token.id, e.token.text, e.token.logprob, e.token.special) for e in events] == [
        (7, "a", -0.5, False), (8, "b", -0.25, False), (9, "c", -0.125, True)]
    assert [e.top_tokens[0].id for e in events] == [7, 8, 9]
    assert [e.token_ids_logprobs for e in events] == [[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]]
    assert [e.hidden_states.tolist() for e in events] == [[[0.0, 1.0, 2.0, 3.0]],
                                                          [[4.0, 5.0, 6.0, 7.0]],
                                                 [[8.0, 9.0, 10.0, 11.0]]]
    assert [e.final is None for e in events] == [True, True, False]
    assert events[-1].final.finish_reason is FinishReason.EOS_TOKEN


async def test_a_decode_call_asks_its_steps_and_ranks_that_took_different_counts_fail_it():
    class Rank(_RecordingRank):
        def __init__(self, steps):
            super().__init__()
            self.steps = steps

        async def call(self, method, message, timeout=None, metadata=None):
            reply = await super().call(method, message, timeout, metadata)
            reply.steps = self.steps
            return reply

    ranks = [Rank(3), Rank(3)]
    result = await ShardedClient(ranks).decode([CachedBatch(9, [4])], max_steps=4)
    assert result.steps == 3 and all(r.sent[0][1].max_steps == 4 for r in ranks)
    with pytest.raises(ShardError, match="different numbers of decode steps"):
        await ShardedClient([Rank(3), Rank(2)]).decode([CachedBatch(9, [4])], max_steps=4)


class _StreamingRank(_RecordingRank):
    """A rank answering DecodeStream with `steps` messages, every one but the last with `more`,
    and Decode with the call's last message; with `fail_after`, an error after that many
    steps (at once for Decode). `closed` tells whether the stream was closed."""

    def __init__(self, steps, fail_after=None):
        super().__init__()
        self.steps, self.fail_after, self.closed = steps, fail_after, False

    def _last(self, message, ids):
        reply = pb.DecodeResponse(generations=[_generation(i) for i in ids], steps=self.steps,
                                  forward_ns=30)
        reply.batch.CopyFrom(pb.CachedBatch(id=message.batches[0].id, request_ids=ids))
        return reply

    async def call(self, method, message, timeout=None, metadata=None):
        self.sent.append((method, message))
        if self.fail_after is not None:
            raise ShardError("the device is gone")
        return self._last(message, [i for b in message.batches for i in b.request_ids])

    async def stream(self, method, message, metadata=None):
        self.sent.append((method, message))
        ids = [i for b in message.batches for i in b.request_ids]
        try:
            for step in range(1, self.steps + 1):
                if step == self.fail_after:
                    raise ShardError("the device is gone")
                await asyncio.sleep(0)
                if step < self.steps:
                    yield pb.DecodeResponse(generations=[_generation(i) for i in ids], more=True)
                else:
                    yield self._last(message, ids)
        finally:
            self.closed = True


async def test_a_streamed_decode_hands_each_step_over_and_returns_the_last():
    ranks = [_StreamingRank(3), _StreamingRank(3)]
    handed = []
    result = await ShardedClient(ranks).decode([CachedBatch(9, [4, 5])], max_steps=4,
                                               on_step=handed.append)
    # rank 0 streams its steps; the others compute the same and answer at the end
    assert [r.sent[0][0] for r in ranks] == ["DecodeStream", "Decode"]
    assert len(handed) == 2 and all(len(s.generations) == 2 for s in handed)
    assert result.steps == 3 and result.timings.forward_ns == 30
    assert result.batch == CachedBatch(9, [4, 5], 0) and len(result.generations) == 2
    assert ranks[0].closed
    # one step a call needs no stream
    rank = _RecordingRank()
    await ShardedClient([rank]).decode([CachedBatch(9, [4])], max_steps=1, on_step=handed.append)
    assert rank.sent[0][0] == "Decode"


@pytest.mark.parametrize("ranks", [
    [_StreamingRank(3), _StreamingRank(2)],  # another step count: collectives would mispair
    [_StreamingRank(3), _StreamingRank(3, fail_after=2)],  # another rank fails
    [_StreamingRank(3, fail_after=3), _StreamingRank(3)],  # rank 0 fails after a step went out
], ids=["steps", "other-rank", "rank-0"])
async def test_a_streamed_decode_fails_as_a_whole_when_a_rank_does(ranks):
    handed = []
    with pytest.raises(ShardError):
        await ShardedClient(ranks).decode([CachedBatch(9, [4])], max_steps=4,
                                          on_step=handed.append)
    assert ranks[0].closed


async def test_an_error_in_the_routers_own_delivery_is_not_the_shards():
    """on_step failing is a router bug: raised as it is (not a ShardError, which would blame
    the shard and probe it), with the stream closed."""
    ranks = [_StreamingRank(3), _StreamingRank(3)]

    def broken(step):
        raise KeyError("a bug in delivery")

    with pytest.raises(KeyError):
        await ShardedClient(ranks).decode([CachedBatch(9, [4])], max_steps=4, on_step=broken)
    assert ranks[0].closed


def test_a_generation_the_shard_ended_with_an_error_fails_its_request_with_that_reason():
    from router.shards.step_types import RequestFailedInShard

    reply = pb.DecodeResponse(generations=[
        _generation(0), _generation(1, error="the grammar could not go on: lexer error")],
        forward_ns=10, decode_ns=2)
    ok, ended = convert.step_result(reply, hidden_size=4).generations
    assert ok.error is None
    assert ended.events == [] and isinstance(ended.error, RequestFailedInShard)
    assert str(ended.error) == "the grammar could not go on: lexer error"
