"""`tgi-launcher`: prepare the model, then start and supervise its shards and the router."""
from __future__ import annotations

import faulthandler
import signal
import sys
from pathlib import Path

from launcher.config import parse_args
from launcher.dotenv import load_dotenv
from launcher.environment import environment_report
from launcher.logs import say
from launcher.resolve import (DEFAULT_MODEL_ID, ModelResolutionError, check_remote_code,
                              resolve_model)
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
    if config.env:
        for line in environment_report():
            say(line, json_output=config.json_output)
    try:
        model_dir = resolve_model(config.model_id, revision=config.revision,
                                  hub_cache=config.huggingface_hub_cache)
        check_remote_code(model_dir, trust_remote_code=config.trust_remote_code)
        check_shardable(model_dir, config.num_shard)
    except (ModelResolutionError, LaunchError) as err:
        say(str(err), json_output=config.json_output, level="ERROR")
        return 1
    return Supervisor(config, model_dir, config.model_id or DEFAULT_MODEL_ID).run()


if __name__ == "__main__":
    sys.exit(main())
