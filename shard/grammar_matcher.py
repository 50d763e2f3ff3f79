"""Grammar-constrained decoding with llguidance: a matcher per constrained request.

llguidance gives lazy token masks, no per-grammar precompilation and broad JSON Schema coverage;
one mask pass per step.
"""
from __future__ import annotations

import json

import llguidance
import torch

GRAMMAR_JSON = "json"
GRAMMAR_REGEX = "regex"
GRAMMAR_EBNF = "ebnf"
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def grammar_source(kind: str, value: str) -> str:
    """llguidance's grammar text for a JSON schema, a regex or an EBNF (GBNF or Lark) grammar.

    A JSON schema's grammar asks for compact JSON output."""
    if kind == GRAMMAR_JSON:
        schema = json.loads(value) if isinstance(value, str) else value
        # no free whitespace: a small model can otherwise pad JSON with blank lines forever
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
    if kind == GRAMMAR_REGEX:
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == GRAMMAR_EBNF:
        return llguidance.grammar_from("ebnf", value)
    raise ValueError(f"unknown grammar type {kind!r}")


class GrammarFactory:
    """Compiles request grammars against the model's vocabulary (the tokenizer is built on first use)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = eos_token_ids
        self._tokenizer = None

    def matcher(self, kind: str, value: str) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self._eos)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_source(kind, value), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
        return matcher


def mask_disallowed(scores: torch.Tensor, matchers: list) -> torch.Tensor:
    """Sets to -inf every token the row's grammar does not allow now; rows without one are kept.

    scores: [B, vocab]. A matcher left with nothing to allow (an error state) allows its EOS only, so
    the request ends instead of sampling from nothing.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    vocab = scores.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    for slot, row in enumerate(rows):
        view = bitmask[slot]
        matchers[row].unsafe_compute_mask_ptr(view.data_ptr(), words * 4)
    allowed = ((bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1).view(len(rows), -1)[:, :vocab].bool()
    allowed = allowed.to(scores.device)
    index = torch.tensor(rows, device=scores.device)
    masked = scores.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return scores.index_copy(0, index, masked)


def advance(matchers: list, token_ids: list[int]) -> None:
    """Feeds each constrained row the token it just produced."""
    for matcher, token in zip(matchers, token_ids):
        if matcher is not None and not matcher.is_stopped():
            matcher.consume_token(token)
