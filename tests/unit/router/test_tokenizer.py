"""The router's tokenizer: the floor on a text's token count that refuses long prompts without
encoding them, and long texts encoded without holding the event loop."""
import random

import pytest

from router.errors import ValidationError
from router.inputs.tokenizer import RouterTokenizer, max_token_bytes
from tests.loop_gaps import LoopGaps


@pytest.fixture
def tokenizer(tiny_llama) -> RouterTokenizer:
    return RouterTokenizer(str(tiny_llama))


def _texts() -> list[str]:
    rng = random.Random(0)
    pieces = ["#" * 80, " " * 50, "\n\n", "<s>", "</s>", "café", "日本語", "🙂", "the", "fox ", "é"]
    texts = ["#" * 5000, " " * 3000, "</s>" * 400, "🙂" * 700, "x"]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 200))) for _ in range(100)]
    texts += ["".join(chr(rng.randint(32, 0x2FFF)) for _ in range(500)) for _ in range(10)]
    return texts


def test_the_floor_never_exceeds_the_real_count(tokenizer):
    assert tokenizer.max_token_bytes is not None  # byte-level BPE: the bound applies
    for text in _texts():
        count = len(tokenizer.tokenizer.encode(text, add_special_tokens=False).ids)
        assert 0 < tokenizer.fewest_tokens(text) <= count, text[:40]


def _spec(**changes) -> dict:
    spec = {"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"},
            "model": {"type": "BPE", "vocab": {"a": 0, "abcd": 1}},
            "added_tokens": [{"content": "<|endoftext|>", "lstrip": False, "rstrip": False}]}
    spec.update(changes)
    return spec


@pytest.mark.parametrize("spec,expected", [
    (_spec(), len("<|endoftext|>")),
    (_spec(added_tokens=[]), 4),
    (_spec(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Isolated"}, {"type": "Digits"}, {"type": "ByteLevel"}]}), 13),
    # each of these may make a token stand for more text than its own characters
    (_spec(normalizer={"type": "NFKC"}), None),
    (_spec(pre_tokenizer={"type": "Metaspace"}), None),
    (_spec(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Removed"}, {"type": "ByteLevel"}]}), None),
    (_spec(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Whitespace"}, {"type": "ByteLevel"}]}), None),
    (_spec(added_tokens=[{"content": "<mask>", "lstrip": True, "rstrip": False}]), None),
    (_spec(model={"type": "Unigram", "vocab": [["a", 0.0]]}), None),
])
def test_the_bound_holds_only_for_tokenizers_that_guarantee_it(spec, expected):
    assert max_token_bytes(spec) == expected


class _NoEncoding:
    def encode(self, *args, **kwargs):
        raise AssertionError("encoded")

    encode_batch = encode


async def test_a_prompt_that_must_be_too_long_is_refused_without_encoding(tokenizer):
    text = "#" * (tokenizer.max_token_bytes * 64 + 1)  # at least 65 tokens
    tokenizer.tokenizer = _NoEncoding()
    with pytest.raises(ValidationError, match="less than 64 tokens. Given: at least 65"):
        await tokenizer.encode_async(text, max_tokens=64)


async def test_a_prompt_that_may_fit_is_encoded(tokenizer):
    text = "#" * (tokenizer.max_token_bytes * 64)
    ids = await tokenizer.encode_async(text, max_tokens=64)
    assert ids == tokenizer.encode(text)  # then the length checks judge it


async def test_a_long_text_is_encoded_without_holding_the_event_loop(tokenizer):
    text = "The quick brown fox jumps over the lazy dog. café 日本語 " * 20_000
    async with LoopGaps() as watch:
        ids, offsets = await tokenizer.encode_offsets_async(text)
    assert ids == tokenizer.encode(text) and len(offsets) == len(ids)
    assert watch.took > 0.2, "the text should take a while to encode"
    # holding the interpreter, the encoding stalled the loop for all of `took`
    assert watch.longest < watch.took / 3, (watch.longest, watch.took)


@pytest.mark.parametrize("count", [0, 1, 1024, 3000])
def test_the_tokens_json_written_in_slices_is_the_whole_list(tokenizer, count):
    import json

    from router.api.tgi.routes import simple_tokens, simple_tokens_json

    text = "café 日本語 \"quoted\"\n" * 400
    encoding = tokenizer.tokenizer.encode(text)
    ids, offsets = encoding.ids[:count], encoding.offsets[:count]
    assert len(ids) == count
    written = simple_tokens_json(text, ids, offsets)
    assert json.loads(written) == simple_tokens(text, ids, offsets)
    assert written == json.dumps(simple_tokens(text, ids, offsets))
