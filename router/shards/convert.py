"""The router's types to the shard contract's messages and back (the mirror of shard/convert.py).

Each request is translated, and each generation read back, on its own: a value the wire cannot
carry, or a generation that cannot be read, fails its own request rather than the batch.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy

from proto import generate_pb2 as pb
from router.schemas import FinalInfo, FinishReason, Token, TokenEvent
from router.shards.step_types import (CachedBatch, Generation, NewBatch, Rejection,
                                      RequestFailedInShard, ShardRequest, StepResult, StepTimings)

log = logging.getLogger("tgi.router.shard_convert")

_GRAMMAR_TYPES = {"json": pb.GRAMMAR_TYPE_JSON, "regex": pb.GRAMMAR_TYPE_REGEX,
                  "ebnf": pb.GRAMMAR_TYPE_EBNF}
_FINISH = {pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
           pb.FINISH_REASON_EOS_TOKEN: FinishReason.EOS_TOKEN,
           pb.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE}


@dataclass(slots=True, frozen=True)
class ShardInfo:
    """What the shards said of themselves at start (InfoResponse), as the router uses it."""

    dtype: str
    device_type: str
    world_size: int
    block_size: int
    max_position_embeddings: int
    support_chunking: bool
    use_prefix_caching: bool
    hidden_size: int  # the width of a row of input embeddings and of hidden states
    speculate: int = 0  # draft tokens a decode step may verify per request (0: none)
    vocab_size: int = 0  # the model's token ids are below it (0: not said)
    architecture: str = ""  # config.json's, e.g. "LlamaForCausalLM" ("": not said)
    quantization: str = ""  # how weights are held where not in dtype ("": all in it)
    generates: bool = True  # False: an encoder, which only embeds
    pooling: str = ""  # how Embed pools ("mean", "cls", "last"...); "": it cannot
    normalize: bool = False  # the checkpoint declares its embeddings normalized
    declares_embedding: bool = False  # a model made to embed (sentence-transformers files)
    matryoshka: bool = False  # a prefix of its embedding is an embedding
    matryoshka_dimensions: tuple[int, ...] = ()  # the prefixes allowed; empty: any
    max_embed_tokens: int = 0  # the longest input Embed takes
    max_adapter_bytes: int = 0  # the most a LoRA adapter's files can hold here (0: none fits)


def shard_info(reply: pb.InfoResponse) -> ShardInfo:
    return ShardInfo(dtype=reply.dtype, device_type=reply.device_type,
                     world_size=reply.world_size, block_size=reply.block_size,
                     max_position_embeddings=reply.max_position_embeddings,
                     support_chunking=reply.support_chunking,
                     use_prefix_caching=reply.use_prefix_caching,
                     hidden_size=reply.hidden_size, speculate=reply.speculate,
                     vocab_size=reply.vocab_size, architecture=reply.architecture,
                     quantization=reply.quantization, generates=reply.generates,
                     pooling=reply.pooling, normalize=reply.normalize,
                     declares_embedding=reply.declares_embedding, matryoshka=reply.matryoshka,
                     matryoshka_dimensions=tuple(reply.matryoshka_dimensions),
                     max_embed_tokens=reply.max_embed_tokens,
                     max_adapter_bytes=reply.max_adapter_bytes)


@dataclass(slots=True, frozen=True)
class AdapterInfo:
    """What the shards read of a LoRA adapter they loaded (LoadAdapterResponse)."""

    rank: int
    alpha: float
    scaling: float  # what its update is multiplied by: alpha / rank (or / sqrt(rank), rsLoRA)
    target_modules: tuple[str, ...]  # PEFT's names of the projections it changes, sorted
    base_model: str  # base_model_name_or_path of its config ("": not said)


def adapter_info(reply: pb.LoadAdapterResponse) -> AdapterInfo:
    return AdapterInfo(rank=reply.rank, alpha=reply.alpha, scaling=reply.scaling,
                       target_modules=tuple(reply.target_modules), base_model=reply.base_model)


# ---- to the shards -----------------------------------------------------------------------------

def request_message(shard_request: ShardRequest) -> pb.Request:
    request = shard_request.request
    s, st = request.sampling, request.stopping
    return pb.Request(
        id=shard_request.id, inputs=request.inputs, input_ids=request.input_ids,
        parameters=pb.NextTokenChooserParameters(
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, typical_p=s.typical_p,
            do_sample=s.do_sample, seed=s.seed, repetition_penalty=s.repetition_penalty,
            watermark=s.watermark, frequency_penalty=s.frequency_penalty, min_p=s.min_p,
            presence_penalty=s.presence_penalty, logit_bias=s.logit_bias,
            frequency_penalty_form=pb.FREQUENCY_PENALTY_PER_SHARE if s.frequency_by_share
            else pb.FREQUENCY_PENALTY_PER_OCCURRENCE,
            grammar_type=_GRAMMAR_TYPES[request.grammar[0]] if request.grammar else
            pb.GRAMMAR_TYPE_NONE,
            grammar=request.grammar[1] if request.grammar else ""),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=st.max_new_tokens, stop_sequences=st.stop_sequences,
            ignore_eos_token=st.ignore_eos, min_new_tokens=st.min_new_tokens,
            stop_token_ids=st.stop_token_ids),
        prefill_logprobs=request.prefill_logprobs, top_n_tokens=request.top_n_tokens,
        blocks=shard_request.blocks, cache_len=shard_request.cache_len,
        chunk_len=shard_request.chunk_len, skip_special_tokens=request.skip_special_tokens,
        input_embeds=request.input_embeds or b"", logprob_token_ids=request.logprob_token_ids,
        prefill_top_n_tokens=request.prefill_top_n_tokens,
        return_hidden_states=request.return_hidden_states, num_beams=request.num_beams,
        length_penalty=request.length_penalty, adapter_id=request.adapter_id,
        images=[pb.Image(data=image.data, token_offset=image.token_offset,
                         token_count=image.token_count) for image in request.images])


def batch_message(batch: NewBatch) -> tuple[pb.Batch, list[Rejection]]:
    """The batch's message, and the requests that could not be translated.

    The message leaves those requests out; they come back as rejections, each with the error. A
    value the wire cannot carry raises when its message is built (protobuf checks ranges and UTF-8
    there), so it fails its own request, not the call."""
    messages, rejected = [], []
    for shard_request in batch.requests:
        try:
            message = request_message(shard_request)
        except Exception as err:
            log.error("request %d could not be put into a message for the shards: %r",
                      shard_request.id, err, exc_info=err)
            rejected.append(Rejection(shard_request.id, f"{type(err).__name__}: {err}", err))
            continue
        messages.append(message)
    return pb.Batch(id=batch.id, requests=messages, size=len(messages),
                    max_tokens=batch.max_tokens, max_blocks=batch.max_blocks), rejected


def cached_batch_message(batch: CachedBatch) -> pb.CachedBatch:
    return pb.CachedBatch(id=batch.id, request_ids=batch.request_ids, size=len(batch.request_ids),
                          max_tokens=batch.max_tokens)


def warmup_message(batch: NewBatch, *, max_input_tokens: int, max_prefill_tokens: int,
                   max_total_tokens: int, max_batch_total_tokens: int,
                   max_batch_size: int | None = None) -> pb.WarmupRequest:
    message, rejected = batch_message(batch)
    if rejected:
        raise ValueError(f"the warm-up batch cannot be sent: {rejected[0].reason}")
    return pb.WarmupRequest(batch=message, max_input_tokens=max_input_tokens,
                            max_prefill_tokens=max_prefill_tokens,
                            max_total_tokens=max_total_tokens,
                            max_batch_total_tokens=max_batch_total_tokens,
                            max_batch_size=max_batch_size)


# ---- from the shards ---------------------------------------------------------------------------

def cached_batch(message: pb.CachedBatch) -> CachedBatch:
    return CachedBatch(message.id, list(message.request_ids), message.max_tokens)


def step_result(reply: pb.PrefillResponse | pb.DecodeResponse, hidden_size: int) -> StepResult:
    """`hidden_size` (ShardInfo's) shapes the rows of hidden states."""
    result = StepResult(generations=[_generation(g, hidden_size) for g in reply.generations],
                        timings=StepTimings(reply.forward_ns, reply.decode_ns,
                                            reply.concat_ns if reply.HasField("concat_ns")
                                            else None))
    if reply.HasField("batch"):
        result.batch = cached_batch(reply.batch)
    if isinstance(reply, pb.PrefillResponse):
        result.rejected = [Rejection(r.request_id, r.reason) for r in reply.rejected]
    else:
        result.draft_tokens, result.accepted_tokens = reply.draft_tokens, reply.accepted_tokens
        result.steps = max(1, reply.steps)
    return result


def _generation(generation: pb.Generation, hidden_size: int) -> Generation:
    if generation.HasField("error"):
        return Generation(generation.request_id, [], RequestFailedInShard(generation.error))
    try:
        return Generation(generation.request_id, generation_events(generation, hidden_size))
    except Exception as err:
        return Generation(generation.request_id, [], err)


def generation_events(generation: pb.Generation, hidden_size: int) -> list[TokenEvent]:
    """One event per token of the generation.

    What was learnt of the prompt comes with the first, the final answer with the last."""
    tokens = generation.tokens
    count = len(tokens.ids)
    if not count:
        raise ValueError("a generation without a token")
    events = [TokenEvent(token=Token(tokens.ids[i], tokens.texts[i], _logprob(tokens.logprobs[i]),
                                     tokens.is_special[i]))
              for i in range(count)]
    first = events[0]
    for event, run in zip(events, generation.top_tokens):
        event.top_tokens = _tokens(run)
    if generation.HasField("prefill_tokens"):
        first.prefill = _tokens(generation.prefill_tokens)
    if generation.prefill_top_tokens:
        first.prefill_top_tokens = [_tokens(run) for run in generation.prefill_top_tokens]
    if generation.token_ids_logprobs:  # tokens x asked ids
        width = len(generation.token_ids_logprobs) // count
        rows = _rows([_logprob(v) for v in generation.token_ids_logprobs], width)
        for event, row in zip(events, rows, strict=True):
            event.token_ids_logprobs = row
        first.prefill_token_ids_logprobs = _rows(
            [_logprob(v) for v in generation.prefill_token_ids_logprobs], width) or None
    if generation.hidden_states:
        # kept float32 rows: router.http.json_out writes them without a Python float each
        values = numpy.frombuffer(generation.hidden_states, dtype="<f4")
        if not hidden_size or values.size % hidden_size:
            raise ValueError(f"{values.size} values are not rows of {hidden_size}")
        values = values.reshape(-1, hidden_size)
        # a prefill's rows are the whole prompt's, with its one token; a step's, one per token
        first.hidden_states = values[:len(values) - count + 1]
        for i, event in enumerate(events[1:], start=len(values) - count + 1):
            event.hidden_states = values[i:i + 1]
    if generation.HasField("generated_text"):
        gt = generation.generated_text
        events[-1].final = FinalInfo(gt.text, gt.generated_tokens, _FINISH[gt.finish_reason],
                                     gt.seed if gt.HasField("seed") else None,
                                     list(gt.token_ids) or None)
    return events


def _tokens(run: pb.Tokens) -> list[Token]:
    special = list(run.is_special) or [False] * len(run.ids)
    return [Token(i, t, _logprob(lp), s)
            for i, t, lp, s in zip(run.ids, run.texts, run.logprobs, special)]


def _rows(values: list, width: int) -> list[list]:
    if not width or len(values) % width:
        raise ValueError(f"{len(values)} values are not rows of {width}")
    return [values[i:i + width] for i in range(0, len(values), width)]


def _logprob(value: float) -> float | None:
    # NaN (not computed) and -inf (a token the grammar masked) have no JSON spelling
    return value if math.isfinite(value) else None
