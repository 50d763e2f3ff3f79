"""Incremental detokenisation on multi-byte text with a byte-level tokenizer."""
import pytest
from tokenizers import Tokenizer

from shard.detokenizer import DetokenizerState, decode_next, flush

TEXTS = ["café naïve façade", "日本語のテキスト", "emoji 🙂 and 👩‍👩‍👧 family", "plain ascii text, with spaces",
         " leading space and trailing "]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_the_text_and_never_hold_broken_utf8(tokenizer, text):
    prompt = tokenizer.encode("The quick brown fox").ids
    generated = tokenizer.encode(text).ids
    ids = list(prompt)
    state = DetokenizerState.start(len(prompt))
    pieces = []
    for token in generated:
        ids.append(token)
        piece = decode_next(tokenizer, ids, state, skip_special_tokens=True)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(flush(tokenizer, ids, state, skip_special_tokens=True))
    assert "".join(pieces) == tokenizer.decode(generated)
    assert "".join(pieces) == text


def test_multibyte_character_is_held_until_complete(tokenizer):
    # the tiny vocabulary splits rare characters into single bytes
    generated = tokenizer.encode("👩").ids
    assert len(generated) > 1
    ids, state = [], DetokenizerState.start(0)
    pieces = []
    for token in generated:
        ids.append(token)
        pieces.append(decode_next(tokenizer, ids, state, skip_special_tokens=True))
    assert pieces[:-1] == [""] * (len(generated) - 1)
    assert pieces[-1] == "👩"
