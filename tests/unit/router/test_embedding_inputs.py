"""The embedding APIs' shared pieces: inputs, Matryoshka prefixes, normalization, base64, and
how the queue sizes its shard calls beside running generations."""
import asyncio
import base64
import math
import struct

import numpy
import pytest

from router.core.embedding import EmbeddingQueue
from router.errors import GenerationError, NotServedError, ValidationError
from router.inputs.embeddings import as_base64, finished, read_dimensions, read_inputs
from router.shards.client import ShardError


@pytest.mark.parametrize("value, inputs", [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]), (["a", [4, 5]], ["a", [4, 5]]),
])
def test_every_openai_input_form_reads(value, inputs):
    assert read_inputs(value, "input", max_inputs=4) == inputs


@pytest.mark.parametrize("value", ["", [], [""], [[]], [1.5], [[1, -2]], [True], {"a": 1}, 5,
                                   ["a"] * 5])
def test_bad_inputs_are_a_422_naming_the_field(value):
    with pytest.raises(ValidationError) as caught:
        read_inputs(value, "input", max_inputs=4)
    assert caught.value.param == "input"


def test_dimensions_only_where_the_model_declares_matryoshka():
    assert read_dimensions(None, "dimensions", hidden_size=64, matryoshka=False, allowed=()) is None
    assert read_dimensions(64, "dimensions", hidden_size=64, matryoshka=False, allowed=()) is None
    assert read_dimensions(16, "dimensions", hidden_size=64, matryoshka=True, allowed=()) == 16
    with pytest.raises(NotServedError, match="Matryoshka"):  # a 400: the model's refusal
        read_dimensions(16, "dimensions", hidden_size=64, matryoshka=False, allowed=())
    for value, matryoshka, allowed in ((65, True, ()), (0, True, ()), (True, True, ()),
                                       (24, True, (16, 32))):
        with pytest.raises(ValidationError, match="dimensions"):
            read_dimensions(value, "dimensions", hidden_size=64, matryoshka=matryoshka,
                            allowed=allowed)


def test_a_prefix_is_normalized_again_and_base64_is_little_endian_float32():
    def vectors(*rows):
        return [numpy.array(row, dtype=numpy.float32) for row in rows]

    cut = finished(vectors([3.0, 4.0, 12.0], [0.0, 0.0, 1.0]), normalize=True, dimensions=2)
    assert numpy.allclose(cut, [[0.6, 0.8], [0.0, 0.0]])  # a zero prefix stays zero
    assert finished(vectors([3.0, 4.0]), normalize=False, dimensions=None).tolist() == [[3.0, 4.0]]
    raw = base64.b64decode(as_base64(numpy.array([1.5, -2.0], dtype=numpy.float32)))
    assert struct.unpack("<2f", raw) == (1.5, -2.0)
    unit = finished(vectors([1.0, 2.0, 2.0]), normalize=True, dimensions=None)[0]
    assert math.isclose(float((unit * unit).sum()), 1.0, rel_tol=1e-6)


class _Shards:
    """Embed calls answered with each input's length, recorded; ids in `refuse` are rejected."""

    def __init__(self, refuse=(), fail=False):
        self.calls, self.refuse, self.fail = [], set(refuse), fail

    async def embed(self, inputs):
        sizes = [len(ids) - start if chunk is None else chunk for _, ids, start, chunk in inputs]
        self.calls.append(sizes)
        await asyncio.sleep(0.001 * sum(sizes))
        if self.fail:
            raise ShardError("gone")
        ended = [(i, ids) for i, ids, _, chunk in inputs if chunk is None]
        return ({i: [float(len(ids))] for i, ids in ended if ids[0] not in self.refuse},
                {i: "too long" for i, ids in ended if ids[0] in self.refuse},
                int(0.001 * sum(sizes) * 1e9))


async def test_inputs_of_concurrent_requests_share_calls_within_the_budget():
    shards = _Shards()
    queue = EmbeddingQueue(shards, decode_s=lambda: None, max_call_tokens=10)
    first, second = await asyncio.gather(queue.embed([[1] * 4, [1] * 4]), queue.embed([[1] * 3]))
    assert first == [[4.0], [4.0]] and second == [[3.0]]
    assert shards.calls == [[4, 4], [3]]  # the third input would pass the 10 tokens


async def test_calls_beside_a_decoding_batch_take_about_half_a_step_of_tokens():
    """A decoder's inputs go in chunks of about half a decode step's tokens; an encoder's whole."""
    shards = _Shards()
    decode = {"s": None}
    queue = EmbeddingQueue(shards, decode_s=lambda: decode["s"], max_call_tokens=1000)
    await queue.embed([[1] * 50] * 4)  # nothing decodes: one call, and a cost per token learned
    assert shards.calls == [[50] * 4] and queue.s_per_token
    decode["s"] = queue.s_per_token * 60  # a decode step costs what 60 tokens do
    assert queue.call_tokens() == 30
    shards.calls.clear()
    assert await queue.embed([[1] * 50, [1] * 20]) == [[50.0], [20.0]]
    # the first in two chunks, the second's first chunk filling the call its rest comes in
    assert shards.calls == [[30], [20, 10], [10]]
    encoder = EmbeddingQueue(_Shards(), decode_s=lambda: 0.001, chunkable=False)
    encoder.s_per_token = 0.001 / 30
    await encoder.embed([[1] * 50, [1] * 20])
    assert encoder.client.calls == [[50], [20]]


async def test_a_refused_input_fails_its_request_alone_and_a_failed_call_its_inputs():
    shards = _Shards(refuse={7})
    queue = EmbeddingQueue(shards, decode_s=lambda: None)
    bad, good = await asyncio.gather(queue.embed([[7, 1]]), queue.embed([[1, 1, 1]]),
                                     return_exceptions=True)
    assert isinstance(bad, ValidationError) and "too long" in str(bad) and good == [[3.0]]
    failing = EmbeddingQueue(_Shards(fail=True), decode_s=lambda: None)
    with pytest.raises(GenerationError):
        await failing.embed([[1]])
    assert await queue.embed([[2]]) == [[1.0]]  # the queue goes on


async def test_beside_a_decoding_batch_calls_alternate_with_its_steps():
    """One Embed call per decode step: the queue waits for the batch's next step between calls."""
    steps = {"n": 0}
    seen = []

    class Counting(_Shards):
        async def embed(self, inputs):
            seen.append(steps["n"])
            return await super().embed(inputs)

    async def decode():  # a step every 30 ms; a call takes 10 (without the wait, 3 a step)
        for _ in range(20):
            await asyncio.sleep(0.03)
            steps["n"] += 1

    queue = EmbeddingQueue(Counting(), decode_s=lambda: 0.03, decode_calls=lambda: steps["n"])
    queue.s_per_token = 0.003  # 10 tokens a call at first
    stepping = asyncio.create_task(decode())
    assert await queue.embed([[1] * 50]) == [[50.0]]
    await stepping
    assert len(seen) >= 2 and len(set(seen)) == len(seen)  # never two calls within one step
