"""--reasoning-parser: a chat answer's reasoning split from its content.

The reasoning goes in `reasoning_content`, the content (the answer) in `content`; for models that
think between `<think>` and `</think>` (DeepSeek R1, Qwen3, QwQ).

One rule, vLLM's `deepseek_r1` (its `qwen3` is the same where they differ in nothing a template
decides): the output is reasoning up to the first `</think>`, and the answer after it; a `<think>`
the model writes itself (a template that does not open the block) is dropped; an output with no
`</think>` (cut by max_tokens) is all reasoning. A prompt that already closed the block (Qwen3's
template given `enable_thinking: false` ends it with `<think>\\n\\n</think>\\n\\n`) makes the whole
output the answer, as vLLM's serving layer decides from the prompt (`prompt_is_reasoning_end`).

The split runs incrementally for streams (ThinkSplitter), holding back at most a tag's length of
text that could begin a tag, so a token boundary inside `</think>` changes nothing: the whole
answer's split is the stream's pieces joined.
"""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
# the names --reasoning-parser takes, all the same rule (vLLM's names for it)
PARSERS = ("think", "deepseek_r1", "qwen3")


def check_parser(name: str | None) -> None:
    """Refuses, at start, a parser this router does not have."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {', '.join(PARSERS)}")


def starts_in_reasoning(prompt: str) -> bool:
    """Whether the output begins inside the thinking block.

    It does unless the prompt ends by closing one (the template wrote an empty block: thinking is
    off, as Qwen3's enable_thinking=false does). Only the end counts: a user's message may quote the
    tags."""
    return not prompt.rstrip().endswith(CLOSE)


def _held(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins one of `tags` (and is not all of it)."""
    for length in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(tag.startswith(text[-length:]) for tag in tags):
            return length
    return 0


@dataclass(slots=True)
class ThinkSplitter:
    """Splits one choice's streamed output into reasoning and content.

    One choice's output, fed as it streams: each feed answers (reasoning, content) that may go
    out now; finish answers what was held back."""

    in_reasoning: bool = True
    opened: bool = False  # the model's own <think> was seen (and dropped): no second one is
    pending: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        text = self.pending + text
        self.pending = ""
        reasoning = ""
        while True:
            close = text.find(CLOSE)
            start = -1 if self.opened else text.find(OPEN)
            if start >= 0 and (close < 0 or start < close):
                reasoning += text[:start]
                text = text[start + len(OPEN):]
                self.opened = True
                continue
            if close >= 0:
                self.in_reasoning = False
                return reasoning + text[:close], text[close + len(CLOSE):]
            held = _held(text, (CLOSE,) if self.opened else (CLOSE, OPEN))
            self.pending = text[len(text) - held:]
            return reasoning + text[:len(text) - held], ""

    def finish(self) -> tuple[str, str]:
        """The text held back, now that no more comes: the rest of the reasoning."""
        held, self.pending = self.pending, ""
        return (held, "") if self.in_reasoning else ("", held)


def split_reasoning(text: str, in_reasoning: bool = True) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content), each None when empty (as vLLM's message has them)."""
    splitter = ThinkSplitter(in_reasoning)
    reasoning, content = splitter.feed(text)
    rest_reasoning, rest_content = splitter.finish()
    return (reasoning + rest_reasoning) or None, (content + rest_content) or None
