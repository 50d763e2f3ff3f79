"""`tgi-launcher`: prepare the model, then start and supervise its shards and the router."""
from __future__ import annotations

import faulthandler
import signal
import sys
from pathlib import Path

import huggingface_hub.utils

from launcher.adapters import resolve_adapters
from launcher.config import LauncherConfig, parse_args
from launcher.dotenv import load_dotenv
from launcher.environment import environment_report
from launcher.gguf_architectures import GGUFError
from launcher.logs import configure as configure_logs
from launcher.logs import say
from launcher.prepare import conversion_dtype
from launcher.resolve import (DEFAULT_MODEL_ID, ModelResolutionError, check_quantization,
                              check_remote_code, resolve_model)
from launcher.supervisor import LaunchError, Supervisor, check_shardable


def main(argv: list[str] | None = None) -> int:
    # `kill -USR1 <pid>` prints every thread's stack: how to see where a stuck process is
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        load_dotenv(Path.cwd() / ".env")
        config = parse_args(argv)
    except ValueError as err:
        print(f"tgi-launcher: {err}", file=sys.stderr)
        return 2
    # before the model is fetched, whose progress is logged
    configure_logs(config.json_output)
    if config.json_output:  # huggingface_hub's bars are no records
        huggingface_hub.utils.disable_progress_bars()
    if config.env:
        for line in environment_report():
            say(line, json_output=config.json_output)
    try:
        model_dir = resolve_model(
            model_source(config), revision=config.revision,
            hub_cache=config.huggingface_hub_cache,
            convert_dtype=conversion_dtype(config.dtype, config.shard_quantize))
        check_remote_code(model_dir, trust_remote_code=config.trust_remote_code)
        check_quantization(model_dir, config.quantize)
        check_shardable(model_dir, config.num_shard)
        # as TGI downloads its adapters beside the model: a bad one ends the start before any
        # shard does. Every machine resolves them: its shards load what the router names.
        adapter_dirs = resolve_adapters(config.adapter_specs(),
                                        hub_cache=config.huggingface_hub_cache)
    except (ModelResolutionError, LaunchError, GGUFError) as err:
        say(str(err), json_output=config.json_output, level="ERROR")
        return 1
    return Supervisor(config, model_dir, config.model_id or DEFAULT_MODEL_ID,
                      adapter_dirs=adapter_dirs).run()


def model_source(config: LauncherConfig) -> str | None:
    """What holds the model's files: --weights-cache-override where given, else --model-id.

    --weights-cache-override is TGI's flag; where it is given, --model-id only names the model."""
    if config.weights_cache_override:
        # absolute: a relative directory that does not exist must not be taken for a Hub id
        return str(Path(config.weights_cache_override).expanduser().resolve())
    return config.model_id


if __name__ == "__main__":
    sys.exit(main())
