"""The public gRPC API's messages <-> TGI's JSON body and the router's types.

Pure functions over proto/api.proto's messages, used by router/api/grpc/service.py (errors'
statuses: router/api/grpc/status.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from proto import api_pb2 as api
from router.schemas import FinishReason, Token, TokenEvent

if TYPE_CHECKING:
    from router.core.generation import GenerateResult
    from router.inputs.validation import ValidatedGenerate

_FINISH_REASONS = {
    FinishReason.LENGTH: api.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: api.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: api.FINISH_REASON_STOP_SEQUENCE,
}


def generate_body(request: api.GenerateRequest) -> dict:
    """TGI's JSON body {inputs, parameters}, with only the parameters that are set.

    Unset ones are left out so that router.inputs.validation applies TGI's defaults and rules to
    them as it does to JSON."""
    parameters = {}
    for field, value in request.parameters.ListFields():
        if field.name == "grammar":
            value = {"type": value.type, "value": value.value}
        elif field.name == "stop":
            value = list(value)
        parameters[field.name] = value
    return {"inputs": request.inputs, "parameters": parameters}


def embed_body(request: api.EmbedRequest) -> dict:
    """TEI's /embed body of one text, with only the fields that are set (as generate_body)."""
    body: dict = {"inputs": request.inputs}
    for name in ("truncate", "normalize", "dimensions"):
        if request.HasField(name):
            body[name] = getattr(request, name)
    if request.truncation_direction == api.TRUNCATION_DIRECTION_LEFT:
        body["truncation_direction"] = "Left"
    return body


# ---- responses -----------------------------------------------------------------------------------

def token(t: Token) -> api.Token:
    return api.Token(id=t.id, text=t.text, logprob=t.logprob, special=t.special)


def prefill_token(t: Token) -> api.PrefillToken:
    return api.PrefillToken(id=t.id, text=t.text, logprob=t.logprob)


def _sequence(result: GenerateResult, message) -> None:
    """Fills the fields BestOfSequence and Details share, as router/api/tgi/routes.py's details."""
    final = result.final
    message.finish_reason = _FINISH_REASONS[final.finish_reason]
    message.generated_tokens = final.generated_tokens
    if final.seed is not None:
        message.seed = final.seed
    message.prefill.extend(prefill_token(t) for t in result.prefill)
    message.tokens.extend(token(t) for t in result.tokens)
    if any(result.top_tokens):
        message.top_tokens.extend(api.TopTokens(tokens=[token(t) for t in step])
                                  for step in result.top_tokens)


def generate_response(best: GenerateResult, others: list[GenerateResult],
                      validated: ValidatedGenerate, prefix: str) -> api.GenerateResponse:
    response = api.GenerateResponse(generated_text=prefix + best.final.text)
    if validated.details or validated.decoder_input_details:
        _sequence(best, response.details)
        for other in others:
            sequence = response.details.best_of_sequences.add(
                generated_text=prefix + other.final.text)
            _sequence(other, sequence)
    return response


def stream_response(event: TokenEvent, index: int, validated: ValidatedGenerate,
                    prefix: str) -> api.GenerateStreamResponse:
    message = api.GenerateStreamResponse(index=index, token=token(event.token),
                                         top_tokens=[token(t) for t in event.top_tokens])
    final = event.final
    if final is not None:
        message.generated_text = prefix + final.text
        if validated.details:
            message.details.CopyFrom(api.StreamDetails(
                finish_reason=_FINISH_REASONS[final.finish_reason],
                generated_tokens=final.generated_tokens, seed=final.seed,
                input_length=validated.request.input_length))
    return message


def tokenize_response(inputs: str, ids: list[int], offsets: list[tuple[int, int]]
                      ) -> api.TokenizeResponse:
    return api.TokenizeResponse(tokens=[
        api.SimpleToken(id=i, text=inputs[start:stop], start=start, stop=stop)
        for i, (start, stop) in zip(ids, offsets)])


def info_response(info: dict) -> api.InfoResponse:
    """/info's JSON as a message: the same names; a null is an unset field."""
    known = api.InfoResponse.DESCRIPTOR.fields_by_name
    fields = {k: v for k, v in info.items() if k in known and v is not None}
    defaults = fields.pop("generation_defaults", None)
    adapters = fields.pop("lora_adapters", [])
    reply = api.InfoResponse(**fields)
    reply.lora_adapters.extend(api.LoraAdapter(**adapter) for adapter in adapters)
    if defaults is not None:
        reply.generation_defaults.CopyFrom(api.GenerationDefaults(
            **{k: v for k, v in defaults.items() if v is not None}))
    return reply


def embed_response(vectors, *, chars: int, tokens: int, total_ns: int) -> api.EmbedResponse:
    """The one text's vector (a [1, width] array), with what it cost."""
    return api.EmbedResponse(embeddings=vectors[0].tolist(), metadata=api.EmbedMetadata(
        compute_chars=chars, compute_tokens=tokens, total_time_ns=total_ns))
