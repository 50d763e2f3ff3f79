"""What OpenAI's chat and legacy completion routes share.

Finish reasons, usage, the stream's error and end frames, and a `model` that
names a LoRA adapter.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from router import VERSION
from router.api.openai.errors import is_openai_sdk, stream_error_body
from router.errors import ModelNotFoundError, RouterError, UnknownAdapterError
from router.http.sse import StreamFormat, openai_sse
from router.schemas import FinishReason

FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop",
          FinishReason.STOP_SEQUENCE: "stop"}
FINGERPRINT = f"{VERSION}-tgi-py"


@contextmanager
def adapter_as_model() -> Iterator[None]:
    """Inside it, an adapter unloaded meanwhile is a 404 model_not_found.

    Meanwhile: after the request's `model` found it. The 404 is what that `model` would get a moment
    later: to these routes an adapter is a model (vLLM's rule)."""
    try:
        yield
    except UnknownAdapterError as err:
        raise ModelNotFoundError(f"model {err.adapter[:200]!r} not found: it was a LoRA adapter, "
                                 "unloaded since; GET /v1/models lists the models and adapters "
                                 "this server knows") from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# OpenAI's schemas want a number where a token has no probability left (-inf, which JSON cannot
# write and the router holds as None): vLLM and OpenAI write -9999.0
LOWEST_LOGPROB = -9999.0


def openai_logprob(value: float | None) -> float:
    """A generated or alternative token's logprob as OpenAI's routes write it."""
    return LOWEST_LOGPROB if value is None or value < LOWEST_LOGPROB else value


class OpenAIStream(StreamFormat):
    """`data: {...}` chunks, an error as a last `data: {"error": ...}`, always `data: [DONE]`.

    The error in the shape its client reads (router.api.openai.errors.stream_error_body)."""

    sdk = False  # an OpenAI SDK's request (bind)

    def bind(self, request: web.Request) -> None:
        self.sdk = is_openai_sdk(request)

    def error(self, err: RouterError) -> bytes:
        return openai_sse(stream_error_body(err, sdk=self.sdk))

    def done(self) -> list[bytes]:
        return [openai_sse("[DONE]")]
