"""The router process's settings, TGI's names and defaults; each field's help becomes its --help,
and the flags machinery below builds tgi-router's and tgi-launcher's flags alike from such fields."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from router.errors import RouterError
from router.inputs.generation_config import GenerationDefaults, check_config
from router.inputs.reasoning import PARSERS, check_parser
from router.kv.sessions import SessionLimits

TRUE_FALSE = ("true", "false")  # a flag taking a word, as TGI's boolean flags; any case


def setting(default, help_text: str, *, shown: str | None = None, choices=None, env: bool = True,
            **metadata):
    """A flag's field. `shown`: its default as --help says it, where the value is computed or
    None means something (required where the default is None); `choices`: its values, where they
    are a closed set; `env`: False for a flag read from the command line only."""
    return field(default=default, metadata={"help": help_text, "shown": shown,
                                            "choices": choices, "env": env, **metadata})


_opt = setting


def _set_by_launcher(default, help_text: str, **kwargs):
    """A flag tgi-launcher gives the router itself. No variable: one of the launcher's flag of the
    same name (MODEL_ID, LORA_ADAPTERS, AUTOSTART, ...) means that flag, not this one."""
    return setting(default, help_text, env=False, set_by_launcher=True, **kwargs)


# a LoRA adapter's name is only ever compared, never made a path: any printable text, as TGI
# names an adapter by its id or directory; without quotes and backslashes, a Prometheus label
MAX_ADAPTER_NAME_CHARS = 512
RESERVED_ADAPTER_NAMES = ("tgi",)  # what an OpenAI request gives when it means "the model"


def adapter_name_problem(name: object) -> str | None:
    """Why `name` cannot name a LoRA adapter, or None (the launcher checks --lora-adapters with
    it before any shard starts; the router, every name it is given)."""
    if (not isinstance(name, str) or not name or len(name) > MAX_ADAPTER_NAME_CHARS
            or not name.isprintable() or name != name.strip() or '"' in name or "\\" in name
            or name in RESERVED_ADAPTER_NAMES):
        return (f"invalid adapter name {str(name)[:200]!r}: printable text of at most "
                f"{MAX_ADAPTER_NAME_CHARS} characters, without quotes, backslashes or spaces at "
                "its ends, and not 'tgi'")
    return None


@dataclass(slots=True)
class RouterConfig:
    tokenizer_path: str = _set_by_launcher(None, "Model directory holding tokenizer.json (and "
                                                 "config files).", shown="none: required")
    model_id: str = _set_by_launcher("", "Model name reported by /info.",
                                     shown="the model directory's name")
    master_shard_uds_path: str = _set_by_launcher("/tmp/tgi-py-server-0", "Unix socket of shard "
                                                  "rank 0; the others are discovered.")
    hostname: str = _opt("0.0.0.0", "Address to listen on.")
    port: int = _opt(8080, "HTTP port.")
    prometheus_port: int = _opt(None, "Also serve GET /metrics on this port, on --hostname "
                                      "(TGI's flag; TGI listens on 9000 by default, tgi-py only "
                                      "when asked). /metrics stays on --port too.",
                                shown="none: /metrics on --port only")
    grpc_port: int = _opt(None, "Port of the public gRPC API (proto/api.proto: Generate, "
                                "GenerateStream, Tokenize, Info, Health, with grpc.health.v1 and "
                                "server reflection), on --hostname.",
                          shown="none: no gRPC server")
    max_concurrent_requests: int = _opt(128, "Requests in flight at once; more get 429.")
    shard_recovery_timeout: float = _opt(60.0, "Seconds a request waits for restarting shards "
                                               "(queued or arriving meanwhile) before a 503.")
    max_best_of: int = _opt(2, "Largest best_of a request may ask.")
    max_stop_sequences: int = _opt(4, "Most stop sequences per request.")
    max_top_n_tokens: int = _opt(5, "Largest top_n_tokens a request may ask.")
    max_input_tokens: int = _opt(None, "Longest prompt in tokens.",
                                 shown="min(4095, context - 1), the context being the model's "
                                       "max_position_embeddings")
    max_total_tokens: int = _opt(None, "Longest prompt + output.", shown="min(4096, context)")
    max_batch_prefill_tokens: int = _opt(None, "Prompt tokens per prefill. A longer prompt is "
                                               "prefilled in chunks of at most this size, each "
                                               "carrying a decode step of the running batch.",
                                         shown="--max-input-tokens + 50; at most 512 on "
                                               "CPU shards")
    max_batch_total_tokens: int = _opt(None, "Tokens of KV cache in all.",
                                       shown="sized by the shards from free memory")
    waiting_served_ratio: float = _opt(0.3, "Waiting/running ratio that interrupts decoding to "
                                            "prefill. Ignored, as in TGI, with shards that chunk "
                                            "prefills (ours do): new requests join at once.")
    max_waiting_tokens: int = _opt(20, "Tokens the running requests may pass (one a decode step, "
                                       "several with --speculate) while a request waits, before "
                                       "it forces a prefill. Ignored, as in TGI, with shards "
                                       "that chunk prefills (ours do).")
    max_batch_size: int = _opt(None, "Most requests in a running batch.", shown="no limit")
    max_decode_steps_per_call: int = _opt(4, "Decode steps the router may ask of the shards in one "
                                             "call while no request waits, as many as fit in "
                                             "50 ms: a round trip saved per token at small "
                                             "batches. Shards on CUDA stream each step's tokens "
                                             "as it ends; on the CPU a call's come together. "
                                             "1: a call per step, as TGI.")
    max_client_batch_size: int = _opt(4, "Most inputs in one client request.")
    tokenizer_config_path: str = _opt(None, "A tokenizer_config.json to take the chat template "
                                            "and the special tokens (bos, eos) from, in place of "
                                            "the model directory's (TGI's flag; the default "
                                            "model only).", shown="none: the model directory's")
    disable_grammar_support: bool = _opt(False, "Refuse, with a 422, every request that "
                                                "constrains its output: TGI's grammar, OpenAI's "
                                                "response_format and tools, SGLang's json_schema, "
                                                "regex and ebnf (TGI's flag).")
    validation_workers: int = _opt(2, "Threads that tokenise and validate requests.")
    prefix_caching: str = _opt("on", "Reuse the KV blocks of prompt prefixes already computed.",
                               choices=("on", "off"))
    api_key: str = _opt(None, "When set, every route but /health, /metrics and the pages "
                              "(GET / and /docs, which ask for the key) needs "
                              "'Authorization: Bearer <key>', and every gRPC call but health "
                              "checks and reflection the metadata 'authorization: Bearer <key>'.",
                        shown="none: no key asked")
    cors_allow_origin: str = _opt(None, "Comma-separated origins allowed by CORS ('*' for any). "
                                        "tgi-launcher also takes the flag once per origin, as "
                                        "TGI does.", shown="none: no CORS headers")
    payload_limit: int = _opt(2_000_000, "Largest request body in bytes; larger ones get 413.")
    reasoning_parser: str = _opt(None, "Split a chat answer's thinking into "
                                       "message.reasoning_content (delta.reasoning_content when "
                                       "streamed), its answer staying in content: think (for "
                                       "<think>...</think> models; deepseek_r1 and qwen3, vLLM's "
                                       "names, are the same rule).", choices=PARSERS,
                                 shown="none: content holds it all")
    otlp_endpoint: str = _opt(None, "OTLP gRPC endpoint (http://host:4317) to export trace spans "
                                    "to.", shown="none: no spans exported")
    otlp_service_name: str = _opt("tgi-py.router", "service.name of the exported spans.")
    # /api/generate-one|batch: what a call's generation_config gets for a field it leaves out
    default_num_beams: int = _opt(1, "generate-one/batch: default num_beams.")
    default_do_sample: str = _opt("false", "generate-one/batch: default do_sample.",
                                  choices=TRUE_FALSE)
    default_temperature: float = _opt(1.0, "generate-one/batch: default temperature.")
    default_top_p: float = _opt(1.0, "generate-one/batch: default top_p.")
    default_top_k: int = _opt(50, "generate-one/batch: default top_k (0: off).")
    default_max_new_tokens: int = _opt(None, "generate-one/batch: default max_new_tokens.",
                                       shown="the room the context leaves, at most 100")
    default_repetition_penalty: float = _opt(1.0, "generate-one/batch: default "
                                                  "repetition_penalty.")
    default_length_penalty: float = _opt(1.0, "generate-one/batch: default length_penalty.")
    session_ttl: float = _opt(600.0, "Seconds an idle request_id session of generate-one/batch "
                                     "keeps its KV blocks; its tokens stay, and its next call "
                                     "computes them again.")
    max_sessions: int = _opt(1024, "request_id sessions remembered; past it the least recently "
                                   "used idle one is forgotten.")
    session_kv_share: float = _opt(0.5, "Share of the KV pool that sessions may hold together; "
                                        "past it the least recently used idle one lets go of "
                                        "its blocks.")
    # set by tgi-launcher: the model lifecycle routes (pull, start, stop) go through its model host
    model_host_uds_path: str = _set_by_launcher(None, "Unix socket of the launcher's model "
                                                      "host.", shown="none: models cannot be "
                                                                     "pulled, started or stopped")
    model_registry_dir: str = _set_by_launcher(None, "Directory of the model registry.",
                                               shown="none: nothing is persisted")
    default_model_dtype: str = _set_by_launcher("", "dtype of models started without one in "
                                                    "their settings.",
                                                shown="each shard's default for its device, "
                                                      "bfloat16 on a CPU with AVX2")
    default_model_device: str = _set_by_launcher("auto", "device of models started without ngl "
                                                         "0.", choices=("cpu", "cuda", "auto"))
    autostart: str = _set_by_launcher("false", "true: models running when the registry was last "
                                               "saved start again.", choices=TRUE_FALSE)
    lora_adapters: str = _set_by_launcher(None, "LoRA adapters to load into the default model "
                                                "before serving: name=directory pairs, comma "
                                                "separated (a bare directory is named after "
                                                "itself). tgi-launcher resolves its "
                                                "--lora-adapters (Hub ids too) to this.",
                                          shown="none")

    def __post_init__(self):
        if not self.tokenizer_path:
            raise ValueError("--tokenizer-path is required: the model directory with tokenizer.json")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests {self.max_concurrent_requests} must be >= 1")
        if self.prefix_caching not in ("on", "off"):
            raise ValueError(f"--prefix-caching {self.prefix_caching!r} must be on or off")
        check_parser(self.reasoning_parser)
        if self.validation_workers < 1:
            raise ValueError(f"--validation-workers {self.validation_workers} must be at least 1")
        for name in ("prometheus_port", "grpc_port"):
            value = getattr(self, name)
            if value is not None and not 0 < value < 65536:
                raise ValueError(f"--{name.replace('_', '-')} {value} must be a port number "
                                 "(1-65535)")
        if self.prometheus_port is not None and self.prometheus_port in (self.port,
                                                                          self.grpc_port):
            raise ValueError(f"--prometheus-port {self.prometheus_port} is also the HTTP --port "
                             "or the --grpc-port; pick another (GET /metrics is on --port "
                             "already)")
        if self.tokenizer_config_path and not os.path.isfile(self.tokenizer_config_path):
            raise ValueError(f"--tokenizer-config-path {self.tokenizer_config_path}: no such "
                             "file")
        if self.payload_limit < 1:
            raise ValueError(f"--payload-limit {self.payload_limit} must be a positive byte count")
        if self.shard_recovery_timeout <= 0:
            raise ValueError(f"--shard-recovery-timeout {self.shard_recovery_timeout} must be > 0")
        if self.grpc_port == self.port:
            raise ValueError(f"--grpc-port {self.grpc_port} is also the HTTP --port; pick another")
        if not 1 <= self.max_decode_steps_per_call <= 64:
            raise ValueError(f"--max-decode-steps-per-call {self.max_decode_steps_per_call} must "
                             "be between 1 and 64")
        if self.waiting_served_ratio < 0:
            raise ValueError(f"--waiting-served-ratio {self.waiting_served_ratio} must be >= 0")
        if self.session_ttl <= 0 or self.max_sessions < 1 or not 0 <= self.session_kv_share <= 1:
            raise ValueError("--session-ttl must be > 0, --max-sessions >= 1 and "
                             "--session-kv-share between 0 and 1")
        self.autostart = self.autostart.lower()
        if self.autostart not in ("true", "false"):
            raise ValueError(f"--autostart {self.autostart!r} must be true or false")
        self.default_do_sample = self.default_do_sample.lower()
        if self.default_do_sample not in ("true", "false"):
            raise ValueError(f"--default-do-sample {self.default_do_sample!r} must be true or "
                             "false")
        self.lora_adapter_dirs()  # its syntax, said at start
        try:
            check_config(self.generation_defaults())
        except RouterError as err:
            raise ValueError(f"a --default-* flag is out of range: {err}") from None

    def generation_defaults(self) -> GenerationDefaults:
        return GenerationDefaults(
            num_beams=self.default_num_beams, do_sample=self.default_do_sample == "true",
            temperature=self.default_temperature, top_p=self.default_top_p,
            top_k=self.default_top_k, max_new_tokens=self.default_max_new_tokens,
            repetition_penalty=self.default_repetition_penalty,
            length_penalty=self.default_length_penalty)

    def lora_adapter_dirs(self) -> list[tuple[str, str]]:
        """--lora-adapters as (name, directory) pairs, in order."""
        pairs: list[tuple[str, str]] = []
        for item in (self.lora_adapters or "").split(","):
            item = item.strip()
            if not item:
                continue
            name, sep, path = item.partition("=")
            if not sep:
                name, path = os.path.basename(item.rstrip("/")), item
            name, path = name.strip(), path.strip()
            if not name or not path:
                raise ValueError(f"--lora-adapters item {item!r}: write name=/path/to/adapter")
            if name in (n for n, _ in pairs):
                raise ValueError(f"--lora-adapters names {name!r} twice; give each adapter its "
                                 "own name")
            pairs.append((name, path))
        return pairs

    def session_limits(self) -> SessionLimits:
        return SessionLimits(max_sessions=self.max_sessions, kv_share=self.session_kv_share,
                             ttl=self.session_ttl)

    def sets_join_rule(self) -> bool:
        """Whether --waiting-served-ratio or --max-waiting-tokens differs from its default."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return any(getattr(self, name) != defaults[name]
                   for name in ("waiting_served_ratio", "max_waiting_tokens"))


def log_level() -> str:
    """LOG_LEVEL (the launcher passes its own on): INFO unless set."""
    return os.environ.get("LOG_LEVEL", "INFO").upper()


# How a setting() field becomes a flag, for tgi-router and tgi-launcher alike: the same field
# gets the same --help (its text, its default, its variable) and the same choices in both.

ENV_HELP = ("Each flag is also read from the environment variable its help names ([env: NAME]); "
            "the command line wins over it, and an empty variable counts as unset. A flag that "
            "takes no value is set by its variable being 1, true or yes.")


def env_name(f: dataclasses.Field) -> str | None:
    """The variable flag `f` is read from, TGI's: its name in upper case; None: flag only."""
    return f.name.upper() if f.metadata.get("env", True) else None


def env_value(f: dataclasses.Field, default):
    """`f`'s variable where it is set; `default` where it is not, or is empty (compose files
    write VAR=${VAR} for variables the user may not set)."""
    name = env_name(f)
    value = os.environ.get(name) if name else None
    return default if value is None or value == "" else value


def env_is_true(f: dataclasses.Field) -> bool:
    return str(env_value(f, "")).lower() in ("1", "true", "yes")


def flag_help(f: dataclasses.Field) -> str:
    """`f`'s --help: its text, then its default and its variable as TGI's --help writes them."""
    shown = f.metadata.get("shown")
    if shown is None:
        if f.default is None:
            raise TypeError(f"setting {f.name}: a default of None must say what it means (shown=)")
        shown = "off" if f.type == "bool" else str(f.default) or '""'
    name = env_name(f)
    source = (f"env: {name}" if name else "flag only, set by tgi-launcher"
              if f.metadata.get("set_by_launcher") else "flag only")
    return f"{f.metadata['help']} [default: {shown}] [{source}]"


def _empty_is_unset(kind):
    """An optional flag given empty is unset, as before its choices were checked (a script's
    `--quantize "$QUANTIZE"`)."""
    return lambda text: None if text == "" else kind(text)


class _OrEmpty(tuple):
    """A flag's choices that also take unset (None: the flag given empty), which --help does not
    list."""

    def __new__(cls, choices):
        made = super().__new__(cls, choices)
        made.choices = choices
        return made

    def __contains__(self, value) -> bool:
        return value is None or value in self.choices


def flag_arguments(f: dataclasses.Field, *, default) -> dict:
    """add_argument's keywords for field `f`: `default` is its value where neither the flag nor
    its variable is given (argparse converts the variable's text with `type`, as the flag's; the
    config checks a variable's value against the choices)."""
    if f.type == "bool":
        return {"action": "store_true", "default": env_is_true(f), "help": flag_help(f)}
    choices = f.metadata.get("choices")
    kind = {"int": int, "float": float}.get(f.type.removesuffix(" | None"), str)
    if choices == TRUE_FALSE:
        kind = str.lower
    if choices is not None and f.default is None:
        kind = _empty_is_unset(kind)
    arguments = {"type": kind, "default": env_value(f, default), "help": flag_help(f)}
    if choices is not None:
        arguments["choices"] = _OrEmpty(choices) if f.default is None else choices
    return arguments


# TGI's router names the tokenizer --tokenizer-name (a Hub id or a directory; here a directory)
_ALIASES = {"tokenizer_path": ["--tokenizer-name"]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tgi-router", description="HTTP front of the shards. "
                                     + ENV_HELP)
    for f in dataclasses.fields(RouterConfig):
        flags = [f"--{f.name.replace('_', '-')}", *_ALIASES.get(f.name, [])]
        parser.add_argument(*flags, **flag_arguments(f, default=f.default))
    return parser


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    return RouterConfig(**vars(build_parser().parse_args(argv)))
