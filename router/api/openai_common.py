"""What OpenAI's chat and legacy completion routes share: finish reasons, usage, the stop-sequence
rule, and the stream's error and end frames."""
from __future__ import annotations

from router.errors import RouterError
from router.openapi import VERSION
from router.schemas import FinishReason
from router.streaming import StreamFormat, openai_sse

FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop",
          FinishReason.STOP_SEQUENCE: "stop"}
FINGERPRINT = f"{VERSION}-tgi-py"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def without_stop(text: str, final, stop_sequences: list[str]) -> str:
    """OpenAI leaves the stop sequence out of the text (TGI's own routes keep it)."""
    if final is not None and final.finish_reason is FinishReason.STOP_SEQUENCE:
        for stop in stop_sequences:
            if text.endswith(stop):
                return text[:-len(stop)]
    return text


class OpenAIStream(StreamFormat):
    """`data: {...}` chunks, an error as a last `data: {"error": ...}`, always `data: [DONE]`."""

    def error(self, err: RouterError) -> bytes:
        return openai_sse({"error": {"message": str(err), "type": err.error_type,
                                     "http_status_code": err.status}})

    def done(self) -> list[bytes]:
        return [openai_sse("[DONE]")]
