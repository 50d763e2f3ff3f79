"""The router's flags as tgi-launcher declares them, reads them and forwards them to tgi-router.

Each is declared once, as a field of the router's settings (router/config/): the launcher takes
those the user gives (the others it sets itself) and passes on only what was given.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from router.config import check_adapter_count, router_config, router_fields
from router.config.flags import env_value, flag_arguments

# given once per origin (as TGI takes it) or directory; the router takes them comma-separated
_REPEATED = {"cors_allow_origin", "allowed_local_model_path"}
_PREFIX = "router."  # the argparse dest of a router flag


def forwarded_router_fields() -> list[dataclasses.Field]:
    """The router's flags the launcher takes and forwards; it gives the others itself."""
    return [f for f in router_fields() if not f.metadata.get("set_by_launcher")]


def add_router_flags(parser: argparse.ArgumentParser,
                     flags: Callable[[str], list[str]]) -> None:
    """The router's flags, in a group of `parser` of their own; `flags`: a field's flag names."""
    group = parser.add_argument_group("router", "Forwarded to the router (tgi-router takes them "
                                      "too, with the same variables).")
    for f in forwarded_router_fields():
        # unset stays None, so that only what the user gave is forwarded
        arguments = flag_arguments(f, default=None)
        if "type" in arguments and "choices" not in arguments:  # choices show as {on,off}
            arguments["metavar"] = f.name.upper()
        if f.name in _REPEATED:  # the environment's value is read in read_router_flags
            arguments.update(action="append", default=None)
        group.add_argument(*flags(f.name), dest=f"{_PREFIX}{f.name}", **arguments)


def read_router_flags(args: dict) -> tuple[dict, dict]:
    """Parsed `args` as (the launcher's own, the router's by field name)."""
    router = {k.removeprefix(_PREFIX): v for k, v in args.items() if k.startswith(_PREFIX)}
    own = {k: v for k, v in args.items() if not k.startswith(_PREFIX)}
    for f in forwarded_router_fields():
        if f.name in _REPEATED:
            given = router.get(f.name)
            router[f.name] = ",".join(given) if given else env_value(f, None)
    return own, router


def check_router_flags(router: dict, *, adapters: int = 0) -> None:
    """A ValueError for a router flag the router would refuse, said before any shard loads.

    `adapters`: how many --lora-adapters names (at most --max-loras)."""
    config = router_config({"tokenizer_path": ".",
                            **{name: value for name, value in router.items()
                               if value is not None}})
    check_adapter_count(adapters, config.model.max_loras)


def router_flags_argv(router: dict) -> list[str]:
    """The router flags the user gave, as tgi-router's command line."""
    argv = []
    for name, value in router.items():
        if value is None or value is False:
            continue
        flag = f"--{name.replace('_', '-')}"
        argv += [flag] if value is True else [flag, str(value)]
    return argv


# seconds of the launcher's grace the router keeps, after its drain, to write the 503s it ended
# the requests still running with and to exit before the launcher's SIGKILL
_ROUTER_EXIT_S = 5.0


def router_drain_timeout(grace: float) -> float:
    """The router's --drain-timeout under the launcher's --graceful-termination-timeout `grace`.

    Most of it: the rest (up to 5 s, half of a short grace) is the router's, to end the requests
    still running with their 503 and exit before the launcher kills it."""
    return grace - min(_ROUTER_EXIT_S, grace / 2)
