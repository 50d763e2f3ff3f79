from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]

class TruncationDirection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRUNCATION_DIRECTION_RIGHT: _ClassVar[TruncationDirection]
    TRUNCATION_DIRECTION_LEFT: _ClassVar[TruncationDirection]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
TRUNCATION_DIRECTION_RIGHT: TruncationDirection
TRUNCATION_DIRECTION_LEFT: TruncationDirection

class GenerateRequest(_message.Message):
    __slots__ = ("inputs", "parameters")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    parameters: GenerateParameters
    def __init__(self, inputs: _Optional[str] = ..., parameters: _Optional[_Union[GenerateParameters, _Mapping]] = ...) -> None: ...

class GenerateParameters(_message.Message):
    __slots__ = ("best_of", "decoder_input_details", "details", "do_sample", "frequency_penalty", "grammar", "max_new_tokens", "repetition_penalty", "return_full_text", "seed", "stop", "temperature", "top_k", "top_n_tokens", "top_p", "truncate", "typical_p", "watermark", "adapter_id", "ignore_eos")
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    DECODER_INPUT_DETAILS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    RETURN_FULL_TEXT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    best_of: int
    decoder_input_details: bool
    details: bool
    do_sample: bool
    frequency_penalty: float
    grammar: Grammar
    max_new_tokens: int
    repetition_penalty: float
    return_full_text: bool
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    temperature: float
    top_k: int
    top_n_tokens: int
    top_p: float
    truncate: int
    typical_p: float
    watermark: bool
    adapter_id: str
    ignore_eos: bool
    def __init__(self, best_of: _Optional[int] = ..., decoder_input_details: _Optional[bool] = ..., details: _Optional[bool] = ..., do_sample: _Optional[bool] = ..., frequency_penalty: _Optional[float] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., return_full_text: _Optional[bool] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_n_tokens: _Optional[int] = ..., top_p: _Optional[float] = ..., truncate: _Optional[int] = ..., typical_p: _Optional[float] = ..., watermark: _Optional[bool] = ..., adapter_id: _Optional[str] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("type", "value")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    type: str
    value: str
    def __init__(self, type: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("id", "text", "logprob", "special")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    special: bool
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., special: _Optional[bool] = ...) -> None: ...

class PrefillToken(_message.Message):
    __slots__ = ("id", "text", "logprob")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    logprob: float
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TopTokens(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ...) -> None: ...

class Details(_message.Message):
    __slots__ = ("finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens", "best_of_sequences")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    generated_tokens: int
    seed: int
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillToken]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopTokens]
    best_of_sequences: _containers.RepeatedCompositeFieldContainer[BestOfSequence]
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[PrefillToken, _Mapping]]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., top_tokens: _Optional[_Iterable[_Union[TopTokens, _Mapping]]] = ..., best_of_sequences: _Optional[_Iterable[_Union[BestOfSequence, _Mapping]]] = ...) -> None: ...

class BestOfSequence(_message.Message):
    __slots__ = ("generated_text", "finish_reason", "generated_tokens", "seed", "prefill", "tokens", "top_tokens")
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    generated_text: str
    finish_reason: FinishReason
    generated_tokens: int
    seed: int
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillToken]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    top_tokens: _containers.RepeatedCompositeFieldContainer[TopTokens]
    def __init__(self, generated_text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[PrefillToken, _Mapping]]] = ..., tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., top_tokens: _Optional[_Iterable[_Union[TopTokens, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("generated_text", "details")
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    generated_text: str
    details: Details
    def __init__(self, generated_text: _Optional[str] = ..., details: _Optional[_Union[Details, _Mapping]] = ...) -> None: ...

class StreamDetails(_message.Message):
    __slots__ = ("finish_reason", "generated_tokens", "seed", "input_length")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INPUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    generated_tokens: int
    seed: int
    input_length: int
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., generated_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., input_length: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("index", "token", "top_tokens", "generated_text", "details")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token: Token
    top_tokens: _containers.RepeatedCompositeFieldContainer[Token]
    generated_text: str
    details: StreamDetails
    def __init__(self, index: _Optional[int] = ..., token: _Optional[_Union[Token, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., generated_text: _Optional[str] = ..., details: _Optional[_Union[StreamDetails, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    def __init__(self, inputs: _Optional[str] = ...) -> None: ...

class SimpleToken(_message.Message):
    __slots__ = ("id", "text", "start", "stop")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    start: int
    stop: int
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[SimpleToken]
    def __init__(self, tokens: _Optional[_Iterable[_Union[SimpleToken, _Mapping]]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "model_sha", "model_pipeline_tag", "model_dtype", "model_device_type", "max_concurrent_requests", "max_best_of", "max_stop_sequences", "max_input_tokens", "max_total_tokens", "max_batch_prefill_tokens", "max_batch_total_tokens", "shard_recovery_timeout", "waiting_served_ratio", "max_waiting_tokens", "max_batch_size", "prefix_caching", "validation_workers", "max_client_batch_size", "router", "version", "sha", "docker_label", "generation_defaults", "session_ttl", "max_sessions", "session_kv_share", "speculate", "max_decode_steps_per_call", "model_architecture", "lora_adapters", "quantization", "takes_images", "max_loras", "embeds")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA_FIELD_NUMBER: _ClassVar[int]
    MODEL_PIPELINE_TAG_FIELD_NUMBER: _ClassVar[int]
    MODEL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BEST_OF_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARD_RECOVERY_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    WAITING_SERVED_RATIO_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CLIENT_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA_FIELD_NUMBER: _ClassVar[int]
    DOCKER_LABEL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_DEFAULTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_KV_SHARE_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODE_STEPS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    MODEL_ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    TAKES_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    EMBEDS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_sha: str
    model_pipeline_tag: str
    model_dtype: str
    model_device_type: str
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    shard_recovery_timeout: float
    waiting_served_ratio: float
    max_waiting_tokens: int
    max_batch_size: int
    prefix_caching: bool
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str
    docker_label: str
    generation_defaults: GenerationDefaults
    session_ttl: float
    max_sessions: int
    session_kv_share: float
    speculate: int
    max_decode_steps_per_call: int
    model_architecture: str
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    quantization: str
    takes_images: bool
    max_loras: int
    embeds: bool
    def __init__(self, model_id: _Optional[str] = ..., model_sha: _Optional[str] = ..., model_pipeline_tag: _Optional[str] = ..., model_dtype: _Optional[str] = ..., model_device_type: _Optional[str] = ..., max_concurrent_requests: _Optional[int] = ..., max_best_of: _Optional[int] = ..., max_stop_sequences: _Optional[int] = ..., max_input_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., max_batch_prefill_tokens: _Optional[int] = ..., max_batch_total_tokens: _Optional[int] = ..., shard_recovery_timeout: _Optional[float] = ..., waiting_served_ratio: _Optional[float] = ..., max_waiting_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., prefix_caching: _Optional[bool] = ..., validation_workers: _Optional[int] = ..., max_client_batch_size: _Optional[int] = ..., router: _Optional[str] = ..., version: _Optional[str] = ..., sha: _Optional[str] = ..., docker_label: _Optional[str] = ..., generation_defaults: _Optional[_Union[GenerationDefaults, _Mapping]] = ..., session_ttl: _Optional[float] = ..., max_sessions: _Optional[int] = ..., session_kv_share: _Optional[float] = ..., speculate: _Optional[int] = ..., max_decode_steps_per_call: _Optional[int] = ..., model_architecture: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., quantization: _Optional[str] = ..., takes_images: _Optional[bool] = ..., max_loras: _Optional[int] = ..., embeds: _Optional[bool] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "parent", "source", "path", "rank", "alpha", "scaling", "target_modules", "base_model", "created")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    name: str
    parent: str
    source: str
    path: str
    rank: int
    alpha: float
    scaling: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    base_model: str
    created: int
    def __init__(self, name: _Optional[str] = ..., parent: _Optional[str] = ..., source: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., alpha: _Optional[float] = ..., scaling: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., base_model: _Optional[str] = ..., created: _Optional[int] = ...) -> None: ...

class GenerationDefaults(_message.Message):
    __slots__ = ("num_beams", "do_sample", "temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty", "length_penalty")
    NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    num_beams: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    repetition_penalty: float
    length_penalty: float
    def __init__(self, num_beams: _Optional[int] = ..., do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., length_penalty: _Optional[float] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "truncate", "normalize", "truncation_direction", "dimensions")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_DIRECTION_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    inputs: str
    truncate: bool
    normalize: bool
    truncation_direction: TruncationDirection
    dimensions: int
    def __init__(self, inputs: _Optional[str] = ..., truncate: _Optional[bool] = ..., normalize: _Optional[bool] = ..., truncation_direction: _Optional[_Union[TruncationDirection, str]] = ..., dimensions: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "metadata")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedScalarFieldContainer[float]
    metadata: EmbedMetadata
    def __init__(self, embeddings: _Optional[_Iterable[float]] = ..., metadata: _Optional[_Union[EmbedMetadata, _Mapping]] = ...) -> None: ...

class EmbedMetadata(_message.Message):
    __slots__ = ("compute_chars", "compute_tokens", "total_time_ns")
    COMPUTE_CHARS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    compute_chars: int
    compute_tokens: int
    total_time_ns: int
    def __init__(self, compute_chars: _Optional[int] = ..., compute_tokens: _Optional[int] = ..., total_time_ns: _Optional[int] = ...) -> None: ...
