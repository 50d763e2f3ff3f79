"""The router process's settings: the server's (server.py) and a model's (model.py).

tgi-router's command line gives both: each of its flags is a field of one of them, which flags.py
turns into a flag, for tgi-router and tgi-launcher alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from router.config.flags import ENV_HELP, flag_arguments
from router.config.model import ModelSettings
from router.config.server import ServerSettings

# TGI's router names the tokenizer --tokenizer-name (a Hub id or a directory; here a directory)
_ALIASES = {"tokenizer_path": ["--tokenizer-name"]}


@dataclass(slots=True)
class RouterConfig:
    """What tgi-router's flags say: the server's settings and its default model's."""

    server: ServerSettings
    model: ModelSettings

    def __post_init__(self):
        check_adapter_count(len(self.server.lora_adapter_dirs()), self.model.max_loras)


def check_adapter_count(count: int, max_loras: int) -> None:
    """A ValueError when --lora-adapters names more adapters than --max-loras lets a model hold."""
    if count > max_loras:
        raise ValueError(f"--lora-adapters names {count} adapters, more than --max-loras "
                         f"({max_loras}) lets the model hold; raise --max-loras")


def router_fields() -> list[dataclasses.Field]:
    """tgi-router's flags, as settings fields: the server's, then the model's."""
    return [*dataclasses.fields(ServerSettings), *dataclasses.fields(ModelSettings)]


def router_config(values: dict) -> RouterConfig:
    """The settings `values` (field name -> value) give; a ValueError says what is wrong."""
    names = {f.name for f in dataclasses.fields(ModelSettings)}
    model = ModelSettings(**{k: v for k, v in values.items() if k in names})
    server = ServerSettings(**{k: v for k, v in values.items() if k not in names})
    return RouterConfig(server, model)


def log_level() -> str:
    """LOG_LEVEL (the launcher passes its own on): INFO unless set."""
    return os.environ.get("LOG_LEVEL", "INFO").upper()


def build_parser() -> argparse.ArgumentParser:
    """tgi-router's flags."""
    parser = argparse.ArgumentParser(prog="tgi-router", description="HTTP front of the shards. "
                                     + ENV_HELP)
    for f in router_fields():
        flags = [f"--{f.name.replace('_', '-')}", *_ALIASES.get(f.name, [])]
        parser.add_argument(*flags, **flag_arguments(f, default=f.default))
    return parser


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    """tgi-router's settings from `argv` and the environment."""
    return router_config(vars(build_parser().parse_args(argv)))
