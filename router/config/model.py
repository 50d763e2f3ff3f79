"""A model's settings: its files and shard socket, its limits, its scheduling and its defaults.

tgi-router's flags give the default model's; a model started later through the model routes
starts from those, with its own directory, socket and the limits its registry settings give
(router/lifecycle/settings.py). Its token limits are resolved once its shards say their context
(router/lifecycle/limits.py).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from router.config.flags import TRUE_FALSE, set_by_launcher, setting
from router.errors import RouterError
from router.inputs.generation_config import GenerationDefaults, check_config
from router.inputs.reasoning import PARSERS, check_parser
from router.inputs.tool_parsers import PARSERS as TOOL_PARSERS
from router.inputs.tool_parsers import check_tool_parser
from router.kv.sessions import SessionLimits

# --max-loras' default: vLLM's (1) counts adapters in one GPU batch, and evicts loaded ones to
# load others; here every loaded adapter may be in any batch and none is evicted
MAX_LORAS = 16


@dataclass(slots=True)
class ModelSettings:
    """One served model's settings (tgi-router's flags about the model it serves)."""

    tokenizer_path: str = set_by_launcher(None, "Model directory holding tokenizer.json (and "
                                                "config files).", shown="none: required")
    model_id: str = set_by_launcher("", "Model name reported by /info.",
                                    shown="the model directory's name")
    master_shard_uds_path: str = set_by_launcher("/tmp/tgi-py-server-0", "Unix socket of shard "
                                                 "rank 0; the others are discovered.")
    max_concurrent_requests: int = setting(128, "Requests in flight at once; more get 429.")
    shard_recovery_timeout: float = setting(60.0, "Seconds a request waits for restarting shards "
                                                  "(queued or arriving meanwhile) before a 503.")
    max_best_of: int = setting(2, "Largest best_of a request may ask.")
    max_stop_sequences: int = setting(4, "Most stop sequences per request.")
    max_top_n_tokens: int = setting(5, "Largest top_n_tokens a request may ask.")
    max_input_tokens: int = setting(None, "Longest prompt in tokens.",
                                    shown="min(4095, context - 1), the context being the model's "
                                          "max_position_embeddings")
    max_total_tokens: int = setting(None, "Longest prompt + output.", shown="min(4096, context)")
    max_batch_prefill_tokens: int = setting(None, "Prompt tokens per prefill. A longer prompt is "
                                                  "prefilled in chunks of at most this size, each "
                                                  "carrying a decode step of the running batch.",
                                            shown="--max-input-tokens + 50; at most 512 on "
                                                  "CPU shards")
    max_batch_total_tokens: int = setting(None, "Tokens of KV cache in all.",
                                          shown="sized by the shards from free memory")
    waiting_served_ratio: float = setting(0.3, "Waiting/running ratio that interrupts decoding to "
                                               "prefill. Ignored, as in TGI, with shards that "
                                               "chunk prefills (ours do): new requests join at "
                                               "once.")
    max_waiting_tokens: int = setting(20, "Tokens the running requests may pass (one a decode "
                                          "step, several with --speculate) while a request "
                                          "waits, before it forces a prefill. Ignored, as in "
                                          "TGI, with shards that chunk prefills (ours do).")
    max_batch_size: int = setting(None, "Most requests in a running batch.", shown="no limit")
    max_decode_steps_per_call: int = setting(4, "Decode steps the router may ask of the shards in "
                                                "one call while no request waits, as many as fit "
                                                "in 50 ms: a round trip saved per token at small "
                                                "batches. Shards on CUDA stream each step's "
                                                "tokens as it ends; on the CPU a call's come "
                                                "together. 1: a call per step, as TGI.")
    max_client_batch_size: int = setting(4, "Most inputs in one client request.")
    max_loras: int = setting(MAX_LORAS, "LoRA adapters a model holds at once (vLLM's flag), "
                                        "those given by --lora-adapters included: a load past "
                                        "it is refused with a 400 until one is unloaded, and no "
                                        "adapter is ever evicted. Each holds its tensors (up to "
                                        "rank 64 on each projection it changes) while loaded; "
                                        "unloading frees them. 0: none.")
    tokenizer_config_path: str = setting(None, "A tokenizer_config.json to take the chat template "
                                               "and the special tokens (bos, eos) from, in place "
                                               "of the model directory's (TGI's flag; the default "
                                               "model only).",
                                         shown="none: the model directory's")
    disable_grammar_support: bool = setting(False, "Refuse, with a 422, every request that "
                                                   "constrains its output: TGI's grammar, "
                                                   "OpenAI's response_format and tools, SGLang's "
                                                   "json_schema, regex and ebnf (TGI's flag).")
    validation_workers: int = setting(2, "Threads that tokenise and validate requests; the "
                                         "default model's also sets the processes (at least 3) "
                                         "that render chat templates.")
    prefix_caching: str = setting("on", "Reuse the KV blocks of prompt prefixes already "
                                        "computed.", choices=("on", "off"))
    reasoning_parser: str = setting(None, "Split a chat answer's thinking into "
                                          "message.reasoning_content (delta.reasoning_content "
                                          "when streamed), its answer staying in content: think "
                                          "(for <think>...</think> models; deepseek_r1 and "
                                          "qwen3, vLLM's names, are the same rule).",
                                    choices=PARSERS, shown="none: content holds it all")
    tool_call_parser: str = setting(None, "Read tool calls from the model's own format (vLLM's "
                                          "flag): hermes (Qwen's <tool_call>), llama3_json, "
                                          "mistral, pythonic. Under tool_choice=auto the model "
                                          "then writes freely and the parser finds its calls; "
                                          "required and a named function still use the grammar.",
                                    choices=tuple(TOOL_PARSERS),
                                    shown="none: a grammar forces JSON calls (TGI's way)")
    enable_auto_tool_choice: bool = setting(False, "Let tool_choice=auto (and tools without a "
                                                   "tool_choice) reach --tool-call-parser; without "
                                                   "it such requests are refused, as vLLM does.")
    # /api/generate-one|batch: what a call's generation_config gets for a field it leaves out
    default_num_beams: int = setting(1, "generate-one/batch: default num_beams.")
    default_do_sample: str = setting("false", "generate-one/batch: default do_sample.",
                                     choices=TRUE_FALSE)
    default_temperature: float = setting(1.0, "generate-one/batch: default temperature.")
    default_top_p: float = setting(1.0, "generate-one/batch: default top_p.")
    default_top_k: int = setting(50, "generate-one/batch: default top_k (0: off).")
    default_max_new_tokens: int = setting(None, "generate-one/batch: default max_new_tokens.",
                                          shown="the room the context leaves, at most 100")
    default_repetition_penalty: float = setting(1.0, "generate-one/batch: default "
                                                     "repetition_penalty.")
    default_length_penalty: float = setting(1.0, "generate-one/batch: default length_penalty.")
    session_ttl: float = setting(600.0, "Seconds an idle request_id session of "
                                        "generate-one/batch keeps its KV blocks; its tokens "
                                        "stay, and its next call computes them again.")
    max_sessions: int = setting(1024, "request_id sessions remembered; past it the least "
                                      "recently used idle one is forgotten.")
    session_kv_share: float = setting(0.5, "Share of the KV pool that sessions may hold "
                                           "together; past it the least recently used idle one "
                                           "lets go of its blocks.")

    def __post_init__(self):
        if not self.tokenizer_path:
            raise ValueError("--tokenizer-path is required: the model directory with tokenizer.json")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests {self.max_concurrent_requests} must be >= 1")
        if self.prefix_caching not in ("on", "off"):
            raise ValueError(f"--prefix-caching {self.prefix_caching!r} must be on or off")
        check_parser(self.reasoning_parser)
        check_tool_parser(self.tool_call_parser, self.enable_auto_tool_choice)
        if self.max_loras < 0:
            raise ValueError(f"--max-loras {self.max_loras} must be >= 0")
        if self.validation_workers < 1:
            raise ValueError(f"--validation-workers {self.validation_workers} must be at least 1")
        if self.tokenizer_config_path and not os.path.isfile(self.tokenizer_config_path):
            raise ValueError(f"--tokenizer-config-path {self.tokenizer_config_path}: no such "
                             "file")
        if self.shard_recovery_timeout <= 0:
            raise ValueError(f"--shard-recovery-timeout {self.shard_recovery_timeout} must be > 0")
        if not 1 <= self.max_decode_steps_per_call <= 64:
            raise ValueError(f"--max-decode-steps-per-call {self.max_decode_steps_per_call} must "
                             "be between 1 and 64")
        if self.waiting_served_ratio < 0:
            raise ValueError(f"--waiting-served-ratio {self.waiting_served_ratio} must be >= 0")
        if self.session_ttl <= 0 or self.max_sessions < 1 or not 0 <= self.session_kv_share <= 1:
            raise ValueError("--session-ttl must be > 0, --max-sessions >= 1 and "
                             "--session-kv-share between 0 and 1")
        self.default_do_sample = self.default_do_sample.lower()
        if self.default_do_sample not in ("true", "false"):
            raise ValueError(f"--default-do-sample {self.default_do_sample!r} must be true or "
                             "false")
        try:
            check_config(self.generation_defaults())
        except RouterError as err:
            raise ValueError(f"a --default-* flag is out of range: {err}") from None

    def generation_defaults(self) -> GenerationDefaults:
        """What a generate-one/batch call gets for a generation_config field it leaves out."""
        return GenerationDefaults(
            num_beams=self.default_num_beams, do_sample=self.default_do_sample == "true",
            temperature=self.default_temperature, top_p=self.default_top_p,
            top_k=self.default_top_k, max_new_tokens=self.default_max_new_tokens,
            repetition_penalty=self.default_repetition_penalty,
            length_penalty=self.default_length_penalty)

    def session_limits(self) -> SessionLimits:
        """The request_id session store's bounds."""
        return SessionLimits(max_sessions=self.max_sessions, kv_share=self.session_kv_share,
                             ttl=self.session_ttl)

    def sets_join_rule(self) -> bool:
        """Whether --waiting-served-ratio or --max-waiting-tokens differs from its default."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return any(getattr(self, name) != defaults[name]
                   for name in ("waiting_served_ratio", "max_waiting_tokens"))
