"""What one HTTP request did, for its access-log line.

The line is router/http/access_log.py's. The middleware makes the record and makes it current for
the request's handler; the layers that learn a part of it fill it in (router.state the model a
request names, the generation core its tokens and its LoRA adapter), wherever the handler's calls
and the tasks they start take them.
"""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    model: str | None = None  # the served model the request named (an adapter's base model)
    adapter_id: str | None = None  # the LoRA adapter its generations ran with
    num_generations: int = 0  # core requests started; their tokens below
    input_tokens: int = 0
    generated_tokens: int = 0
    # a generation's error after the answer's status went out (a stream's last frame says it)
    error_type: str | None = None
    # prompts counted: copies of one prompt (n > 1, best_of) share its list of ids
    _prompt_ids: set[int] = field(default_factory=set)

    def generation_started(self, prompt: object, input_length: int,
                           adapter_id: str | None) -> None:
        """Records that a core request started.

        `prompt` (its input ids) counts once however many copies of it are generated."""
        self.num_generations += 1
        if id(prompt) not in self._prompt_ids:
            self._prompt_ids.add(id(prompt))
            self.input_tokens += input_length
        if adapter_id is not None:
            self.adapter_id = adapter_id


_CURRENT: ContextVar[RequestRecord | None] = ContextVar("request_record", default=None)


def current_record() -> RequestRecord | None:
    """The record of the HTTP request being handled.

    None outside one (the gRPC API, tests that call the core directly)."""
    return _CURRENT.get()


def make_current(record: RequestRecord | None):
    """Makes `record` current; returns the token that `reset_current` takes."""
    return _CURRENT.set(record)


def reset_current(token) -> None:
    _CURRENT.reset(token)
