"""Protobuf messages <-> the engine's dataclasses.

With server.py, the only shard module that knows proto."""
from __future__ import annotations

import torch

from proto import generate_pb2 as pb
from shard.batch_state import NewRequest, PromptImage
from shard.grammar_matcher import GRAMMAR_EBNF, GRAMMAR_JSON, GRAMMAR_REGEX
from shard.images.admission import ImageSupport
from shard.outputs import BatchInfo, RequestOutput, StepOutput, TokenRun
from shard.sampling import SamplingParams
from shard.stopping import FinishReason

_GRAMMAR_KINDS = {pb.GRAMMAR_TYPE_JSON: GRAMMAR_JSON, pb.GRAMMAR_TYPE_REGEX: GRAMMAR_REGEX,
                  pb.GRAMMAR_TYPE_EBNF: GRAMMAR_EBNF}
# by name, not by number: the two enums agreeing on numbers would be a coincidence to keep
_FINISH_REASONS = {FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
                   FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
                   FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE}


def _or(value: float, default: float) -> float:
    # proto3 cannot tell 0 from unset; for multiplicative parameters 0 means "off"
    return value if value else default


def sampling_params(p: pb.NextTokenChooserParameters, top_n_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=_or(p.temperature, 1.0), top_k=p.top_k, top_p=_or(p.top_p, 1.0),
        typical_p=_or(p.typical_p, 1.0), min_p=p.min_p,
        repetition_penalty=_or(p.repetition_penalty, 1.0),
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        frequency_by_share=p.frequency_penalty_form == pb.FREQUENCY_PENALTY_PER_SHARE,
        do_sample=p.do_sample, seed=p.seed, top_n_tokens=top_n_tokens, watermark=p.watermark,
        logit_bias=dict(p.logit_bias))


def new_request(r: pb.Request, hidden_size: int) -> NewRequest:
    """`hidden_size` shapes the rows of input_embeds."""
    grammar = None
    if r.parameters.grammar_type != pb.GRAMMAR_TYPE_NONE:
        kind = _GRAMMAR_KINDS.get(r.parameters.grammar_type)
        if kind is None:  # a newer router's type: that request alone is refused
            raise ValueError(f"grammar type {r.parameters.grammar_type} is not known to this shard")
        grammar = (kind, r.parameters.grammar)
    stopping = r.stopping_parameters
    embeds = None
    if r.input_embeds:
        if len(r.input_embeds) % (4 * hidden_size):
            raise ValueError(f"input_embeds must be rows of {hidden_size} float32 values (the "
                             "model's hidden size)")
        # copied: the tensor outlives the message, whose bytes are read-only
        embeds = torch.frombuffer(bytearray(r.input_embeds), dtype=torch.float32)
        embeds = embeds.view(-1, hidden_size)
    return NewRequest(
        id=r.id, input_ids=list(r.input_ids),
        params=sampling_params(r.parameters, r.top_n_tokens),
        max_new_tokens=stopping.max_new_tokens, stop_sequences=list(stopping.stop_sequences),
        ignore_eos=stopping.ignore_eos_token, min_new_tokens=stopping.min_new_tokens,
        stop_token_ids=list(stopping.stop_token_ids), prefill_logprobs=r.prefill_logprobs,
        blocks=list(r.blocks), cache_len=r.cache_len, skip_special_tokens=r.skip_special_tokens,
        grammar=grammar, chunk_len=r.chunk_len if r.HasField("chunk_len") else None,
        input_embeds=embeds, logprob_token_ids=list(r.logprob_token_ids),
        prefill_top_n_tokens=r.prefill_top_n_tokens, return_hidden_states=r.return_hidden_states,
        num_beams=max(r.num_beams, 1), length_penalty=r.length_penalty,
        adapter=r.adapter_id or None,
        images=[PromptImage(image.data, image.token_offset, image.token_count)
                for image in r.images])


def image_fields(support: ImageSupport | None) -> dict:
    """InfoResponse's fields saying whether the model takes images, and how a prompt holds one."""
    if support is None:
        return {"takes_images": False}
    scheme = support.tokens
    return dict(takes_images=True, image_token_id=scheme.token_id,
                image_tokens_per_image=scheme.per_image, image_start_token_id=scheme.start_id,
                image_end_token_id=scheme.end_id)


def tokens(run: TokenRun) -> pb.Tokens:
    return pb.Tokens(ids=run.ids, logprobs=run.logprobs, texts=run.texts, is_special=run.is_special)


def generation(g: RequestOutput) -> pb.Generation:
    message = pb.Generation(request_id=g.request_id, tokens=tokens(g.tokens),
                            top_tokens=[tokens(t) for t in g.top_tokens],
                            token_ids_logprobs=g.token_ids_logprobs)
    if g.prompt is not None:
        if g.prompt.tokens is not None:
            message.prefill_tokens.CopyFrom(tokens(g.prompt.tokens))
        message.prefill_top_tokens.extend(tokens(t) for t in g.prompt.top_tokens)
        message.prefill_token_ids_logprobs.extend(g.prompt.token_ids_logprobs)
    if g.hidden_states is not None:
        message.hidden_states = g.hidden_states.numpy().astype("<f4").tobytes()
    if g.error is not None:
        message.error = g.error
    if g.generated_text is not None:
        gt = g.generated_text
        message.generated_text.CopyFrom(pb.GeneratedText(
            text=gt.text, generated_tokens=gt.generated_tokens,
            finish_reason=_FINISH_REASONS[gt.finish_reason], seed=gt.seed,
            token_ids=gt.token_ids or []))
    return message


def cached_batch(info: BatchInfo) -> pb.CachedBatch:
    return pb.CachedBatch(id=info.id, request_ids=info.request_ids, size=len(info.request_ids),
                          max_tokens=info.max_tokens, current_tokens=info.current_tokens)


def step_response(result: StepOutput, message_class):
    response = message_class(generations=[generation(g) for g in result.generations],
                             forward_ns=result.forward_ns, decode_ns=result.decode_ns,
                             total_ns=result.total_ns)
    if result.batch is not None:
        response.batch.CopyFrom(cached_batch(result.batch))
    if result.concat_ns is not None:
        response.concat_ns = result.concat_ns
    for request_id, reason in result.rejected:
        response.rejected.add(request_id=request_id, reason=reason)
    # a Prefill's riding batch may take its step alone (every new request refused); only a Decode
    # reports drafts
    if result.draft_tokens and message_class is pb.DecodeResponse:
        response.draft_tokens = result.draft_tokens
        response.accepted_tokens = result.accepted_tokens
    if message_class is pb.DecodeResponse:
        response.steps = result.steps
    return response
