"""One generation of an SGLang request as its events arrive: its answer, and its stream's frames.

A frame carries the text so far, as SGLang's default stream does (`text` is cumulative there too),
and in its meta_info only what is new since the frame before: the log-probabilities, top
log-probabilities, named-token log-probabilities and hidden states of the tokens it adds, and the
prompt's in the first frame alone (SGLang's --incremental-streaming-output slices them so; without
it SGLang re-sends them all in every frame, which made a stream's bytes, and a slow reader's
backlog, grow with the square of its tokens). Concatenating the frames' lists gives the plain
answer's.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from router.api.sglang.request import SglangItem
from router.core.generation import FanOutStream
from router.schemas import FinalInfo, FinishReason, GenerateRequest, Timings, Token, TokenEvent


@dataclass(slots=True)
class Sent:
    """How much of a run's per-token lists the frames so far carried."""

    tokens: int = 0  # output tokens: their log-probabilities and top log-probabilities
    ids_logprobs: int = 0  # output positions' named-token log-probabilities
    hidden_states: int = 0  # entries of hidden_states (the prompt's rows count as one)
    prompt: bool = False  # the prompt's log-probabilities


@dataclass(frozen=True, slots=True)
class Frame:
    """A stream's frame, made as its event arrived; its text is joined as it is written."""

    meta_info: dict
    num_tokens: int  # the text so far is that of the first num_tokens tokens...
    final_text: str | None  # ...but in the last frame, which says the answer's text
    numbers: int  # how many numbers meta_info holds (router.http.json_out encodes by it)


@dataclass(eq=False)
class Run:
    """One generation of an SGLang request, as its events arrive."""

    item: SglangItem
    timings: Timings
    tokens: list[Token] = field(default_factory=list)
    top_tokens: list[list[Token]] = field(default_factory=list)
    prefill: list[Token] = field(default_factory=list)
    prefill_top_tokens: list[list[Token]] = field(default_factory=list)
    prefill_ids_logprobs: list[list[float | None]] = field(default_factory=list)
    ids_logprobs: list[list[float | None]] = field(default_factory=list)  # per output token
    hidden_states: list = field(default_factory=list)  # the prompt's rows, then one per step
    final: FinalInfo | None = None
    stream: FanOutStream = field(init=False)  # its stream in the fan-out: aborts it alone
    # streamed: each event's frame, made as it is recorded (the run may have recorded later
    # events, several a decode call, before the writer gets to this one); `frame_index` is the
    # index a frame carries in a batch
    frames: deque[Frame | None] | None = None
    frame_index: int | None = None
    sent: Sent = field(default_factory=Sent)

    def __post_init__(self) -> None:
        self.stream = FanOutStream(timings=self.timings)

    def stream_frames(self, index: int | None) -> None:
        self.frames, self.frame_index = deque(), index

    def keep_frame(self) -> None:
        """Frames what arrived since the last frame, every `stream_interval` tokens and at the end.

        An event between two frames gets None: its tokens go out with the next frame."""
        if self.frames is None:
            return
        if not self.done and len(self.tokens) % self.item.stream_interval:
            self.frames.append(None)
            return
        sent = self.sent
        self.frames.append(Frame(self.meta_info(sent), len(self.tokens),
                                 self.text() if self.done else None, self.numbers(sent)))
        self.sent = Sent(len(self.tokens), len(self.ids_logprobs), len(self.hidden_states),
                         sent.prompt or bool(self.tokens))

    def frame_output(self, frame: Frame) -> dict:
        """What `frame` says: the text so far and its meta_info."""
        text = frame.final_text
        if text is None:
            text = "".join(t.text for t in self.tokens[:frame.num_tokens])
        out = {"text": text, "meta_info": frame.meta_info}
        if self.frame_index is not None:
            out["index"] = self.frame_index
        return out

    @property
    def request(self) -> GenerateRequest:
        return self.item.request

    def record(self, event: TokenEvent) -> None:
        if event.final is not None:
            self.final = event.final
        if event.hidden_states is not None:
            # SGLang's layout: the prompt's rows as one entry, then one vector per decode step
            self.hidden_states.append(event.hidden_states if not self.hidden_states
                                      else event.hidden_states[0])
        if event.prefill is not None:
            self.prefill = event.prefill
        if event.prefill_top_tokens is not None:
            self.prefill_top_tokens = event.prefill_top_tokens
        if event.prefill_token_ids_logprobs is not None:
            self.prefill_ids_logprobs = event.prefill_token_ids_logprobs
        if self.item.score_only:  # the token the prefill sampled is no part of the answer
            return
        self.tokens.append(event.token)
        self.top_tokens.append(event.top_tokens)
        if event.token_ids_logprobs:
            self.ids_logprobs.append(event.token_ids_logprobs)

    def abort(self) -> None:
        self.stream.abort()

    @property
    def aborted(self) -> bool:
        return self.stream.aborted

    def arrived(self, event: TokenEvent) -> None:
        """Records an event as the core hands it over.

        The writer may lag behind. The event is framed too when streamed; an aborted run's last
        event is framed only."""
        if not self.aborted:
            self.record(event)
        self.keep_frame()

    @property
    def done(self) -> bool:
        return self.final is not None or self.aborted

    def text(self) -> str:
        """The text so far; at the end without what stopped it, unless `no_stop_trim`."""
        final = self.final
        if final is None or self.item.score_only:
            return "".join(t.text for t in self.tokens)
        text = final.text
        if self.item.no_stop_trim:
            return text
        if final.finish_reason is FinishReason.STOP_SEQUENCE:
            stop = self._matched_stop(text)
            return text[:-len(stop)] if stop else text
        if final.finish_reason is FinishReason.EOS_TOKEN and self.tokens:
            last = self.tokens[-1].text
            if last and text.endswith(last):
                return text[:-len(last)]
        return text

    def _matched_stop(self, text: str) -> str | None:
        ends = [s for s in self.request.stopping.stop_sequences if text.endswith(s)]
        return max(ends, key=len) if ends else None

    def finish_reason(self) -> dict | None:
        if self.aborted:
            return {"type": "abort", "message": "aborted by /abort_request"}
        final = self.final
        if final is None:
            return None
        if final.finish_reason is FinishReason.LENGTH or self.item.score_only:
            return {"type": "length",
                    "length": 0 if self.item.score_only else self.request.stopping.max_new_tokens}
        if final.finish_reason is FinishReason.STOP_SEQUENCE:
            return {"type": "stop", "matched": self._matched_stop(final.text)}
        # an end-of-sequence id or one of stop_token_ids: the last token
        return {"type": "stop", "matched": self.tokens[-1].id if self.tokens else None}

    def _prompt_rows(self, rows: list, since: Sent) -> list:
        """The prompt's rows from logprob_start_len on, unless a frame carried them already."""
        start = self.item.logprobs.start_len
        return rows[start:] if start >= 0 and not since.prompt else []

    def meta_info(self, since: Sent | None = None) -> dict:
        """The run's meta_info; with `since`, per-token lists hold only what came after it."""
        since = since or Sent()
        meta = {"id": self.item.rid, "finish_reason": self.finish_reason(),
                "prompt_tokens": self.request.input_length,
                "completion_tokens": len(self.tokens),
                "cached_tokens": self.timings.cached_tokens,
                "e2e_latency": time.monotonic() - self.timings.started_at}
        options = self.item.logprobs
        if options.enabled:
            entry = (lambda t: [t.logprob, t.id, t.text]) if options.with_text else \
                (lambda t: [t.logprob, t.id, None])
            start = options.start_len
            prompt = self._prompt_rows(self.prefill, since)
            if prompt and start == 0:  # the first prompt token has no log-probability
                prompt = [Token(prompt[0].id, prompt[0].text, None)] + prompt[1:]
            meta["input_token_logprobs"] = [entry(t) for t in prompt]
            meta["output_token_logprobs"] = [entry(t) for t in self.tokens[since.tokens:]]
            if options.top_n:
                meta["input_top_logprobs"] = [
                    [entry(t) for t in step] or None
                    for step in self._prompt_rows(self.prefill_top_tokens, since)]
                meta["output_top_logprobs"] = [[entry(t) for t in step]
                                               for step in self.top_tokens[since.tokens:]]
            asked = options.token_ids
            if asked:
                texts = options.token_texts
                named = (lambda row: [[lp, i, text] for lp, i, text in zip(row, asked, texts)])
                meta["input_token_ids_logprobs"] = [
                    named(row) if position + max(start, 0) else None
                    for position, row in enumerate(
                        self._prompt_rows(self.prefill_ids_logprobs, since))]
                meta["output_token_ids_logprobs"] = [
                    named(row) for row in self.ids_logprobs[since.ids_logprobs:]]
        if self.item.return_hidden_states:
            meta["hidden_states"] = self.hidden_states[since.hidden_states:]
        return meta

    def numbers(self, since: Sent | None = None) -> int:
        """About how many numbers meta_info(since) holds: what its JSON costs to encode."""
        since = since or Sent()
        count = 8
        options = self.item.logprobs
        if options.enabled:
            per_position = 1 + options.top_n + len(options.token_ids)
            count += per_position * (len(self.tokens) - since.tokens
                                     + len(self._prompt_rows(self.prefill, since)))
        if self.item.return_hidden_states:  # the prompt's rows, then one row a token
            count += sum(entry.size for entry in self.hidden_states[since.hidden_states:])
        return count

    def output(self) -> dict:
        """The plain (not streamed) answer: the text and the whole meta_info."""
        return {"text": self.text(), "meta_info": self.meta_info()}

