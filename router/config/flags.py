"""How a settings field becomes a flag, for tgi-router and tgi-launcher alike.

The same field gets the same --help (its text, its default, its variable) and the same choices in
both commands.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import field

TRUE_FALSE = ("true", "false")  # a flag taking a word, as TGI's boolean flags; any case


def setting(default, help_text: str, *, shown: str | None = None, choices=None, env: bool = True,
            **metadata):
    """A flag's field, its help text becoming its --help.

    `shown`: its default as --help says it, where the value is computed or None means something
    (required where the default is None); `choices`: its values, where they are a closed set;
    `env`: False for a flag read from the command line only.
    """
    return field(default=default, metadata={"help": help_text, "shown": shown,
                                            "choices": choices, "env": env, **metadata})


def set_by_launcher(default, help_text: str, **kwargs):
    """A flag tgi-launcher gives the router itself.

    No variable: one of the launcher's flag of the same name (MODEL_ID, LORA_ADAPTERS, AUTOSTART,
    ...) means that flag, not this one.
    """
    return setting(default, help_text, env=False, set_by_launcher=True, **kwargs)


ENV_HELP = ("Each flag is also read from the environment variable its help names ([env: NAME]); "
            "the command line wins over it, and an empty variable counts as unset. A flag that "
            "takes no value is set by its variable being 1, true or yes.")


def env_name(f: dataclasses.Field) -> str | None:
    """The variable flag `f` is read from, TGI's: its name in upper case; None: flag only."""
    return f.name.upper() if f.metadata.get("env", True) else None


def env_value(f: dataclasses.Field, default):
    """`f`'s variable where it is set; `default` where it is not, or is empty.

    Compose files write VAR=${VAR} for variables the user may not set.
    """
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
    """A flag type under which an optional flag given empty is unset.

    As before its choices were checked (a script's `--quantize "$QUANTIZE"`).
    """
    return lambda text: None if text == "" else kind(text)


class _OrEmpty(tuple):
    """A flag's choices that also take unset (None: the flag given empty).

    --help does not list the unset value.
    """

    def __new__(cls, choices):
        self = super().__new__(cls, choices)
        self.choices = choices
        return self

    def __contains__(self, value) -> bool:
        return value is None or value in self.choices


def flag_arguments(f: dataclasses.Field, *, default) -> dict:
    """add_argument's keywords for field `f`.

    `default` is its value where neither the flag nor its variable is given (argparse converts
    the variable's text with `type`, as the flag's; the config checks a variable's value against
    the choices).
    """
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
