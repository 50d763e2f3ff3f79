"""`tgi-launcher`: prepare the model, then start and supervise its shards and the router."""
from __future__ import annotations

import sys

from launcher.config import parse_args
from launcher.resolve import DEFAULT_MODEL_ID, ModelResolutionError, resolve_model
from launcher.supervisor import LaunchError, Supervisor, check_shardable


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_args(argv)
    except ValueError as err:
        print(f"tgi-launcher: {err}", file=sys.stderr)
        return 2
    try:
        model_dir = resolve_model(config.model_id, revision=config.revision)
        check_shardable(model_dir, config.num_shard)
    except (ModelResolutionError, LaunchError) as err:
        print(f"tgi-launcher: {err}", file=sys.stderr)
        return 1
    model_name = config.model_id or DEFAULT_MODEL_ID
    return Supervisor(config, model_dir, model_name).run()


if __name__ == "__main__":
    sys.exit(main())
