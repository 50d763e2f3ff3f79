"""--help, as TGI's: every flag of tgi-launcher and tgi-router says its default and the environment
variable it is read from (and that variable, set, is what the flag takes), its choices where they
are a closed set (argparse refusing another value, naming them), and a router flag says the same in
both commands."""
import argparse
import re

import pytest

from launcher.config import build_parser as launcher_parser
from launcher.config import parse_args
from launcher.router_flags import forwarded_router_fields
from router.config import build_parser as router_parser

HELP_TAIL = re.compile(r" \[default: (?P<default>[^\]]+)\] \[(?:env: (?P<env>[A-Z0-9_]+)|"
                       r"(?P<flag_only>flag only[^\]]*))\]$")


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings
            and not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]


def _long(action: argparse.Action) -> str:
    return next(s for s in action.option_strings if s.startswith("--"))


def _variable_value(action: argparse.Action) -> tuple[str, object]:
    """A value to set a flag's variable to, and what the flag then holds."""
    if action.nargs == 0:  # store_true
        return "true", True
    if action.choices:
        choice = next(c for c in action.choices if c != action.default)
        return choice, choice
    kind = action.type or str
    return {int: ("7", 7), float: ("0.25", 0.25)}.get(kind, ("some-value", "some-value"))


@pytest.mark.parametrize("build", [launcher_parser, router_parser], ids=["launcher", "router"])
def test_every_flag_names_its_default_and_the_variable_it_reads(build, monkeypatch):
    for action in _flags(build()):
        flag = _long(action)
        tail = HELP_TAIL.search(action.help)
        assert tail, f"{flag}: no [default: ...] [env: ...] at the end of {action.help!r}"
        assert tail["default"] not in ("None", ""), f"{flag}: say what an unset value means"
        name = flag.removeprefix("--").replace("-", "_").upper()
        if tail["flag_only"]:
            monkeypatch.setenv(name, _variable_value(action)[0])
            assert getattr(build().parse_args([]), action.dest) == action.default, \
                f"{flag} is said to be a flag only, but {name} sets it"
            continue
        assert tail["env"] == name, f"{flag}: TGI's variable is {name}"
        text, value = _variable_value(action)
        monkeypatch.setenv(name, text)
        parsed = getattr(build().parse_args([]), action.dest)
        if action.dest in ("router.cors_allow_origin", "router.allowed_local_model_path"):
            parsed = parse_args([]).router[action.dest.removeprefix("router.")]  # read there
        assert parsed == value, f"{flag} does not read {name}"
        monkeypatch.delenv(name)


def test_a_router_flag_says_the_same_in_the_launcher_and_the_router():
    router = {_long(a): a for a in _flags(router_parser())}
    launcher = {_long(a): a for a in _flags(launcher_parser())}
    forwarded = [f"--{f.name.replace('_', '-')}" for f in forwarded_router_fields()]
    assert forwarded and "--port" in forwarded and "--model-id" not in forwarded
    for flag in forwarded:
        assert launcher[flag].help == router[flag].help, flag
        assert launcher[flag].choices == router[flag].choices, flag
        assert launcher[flag].metavar in (router[flag].metavar, flag[2:].replace("-", "_").upper())


def test_computed_defaults_say_what_they_are_computed_from():
    helps = {_long(a): a.help for a in _flags(launcher_parser())}
    assert "[default: min(4095, context - 1)" in helps["--max-input-tokens"]
    assert ("[default: --max-input-tokens + 50; at most 512 on CPU shards]"
            in helps["--max-batch-prefill-tokens"])
    assert "[default: bfloat16 on a CPU with AVX2" in helps["--dtype"]
    assert "[default: 8080] [env: PORT]" in helps["--port"]
    assert "[flag only]" in helps["--nnodes"]


@pytest.mark.parametrize("argv, offered", [
    (["--dtype", "float64"], ["float32", "bfloat16", "float16"]),
    (["--device", "mps"], ["cpu", "cuda", "auto"]),
    (["--quantize", "int2"], ["int8", "int4", "fp8", "gptq", "awq", "marlin",
                              "compressed-tensors"]),
    (["--kv-cache-dtype", "int4"], ["float32", "bfloat16", "float16", "int8"]),
    (["--sharded", "maybe"], ["true", "false"]),
    (["--prefix-caching", "sometimes"], ["on", "off"]),
    (["--reasoning-parser", "o1"], ["think", "deepseek_r1", "qwen3"]),
    (["--usage-stats", "loud"], ["on", "off", "no-stack"]),
])
def test_a_value_outside_the_choices_is_refused_naming_them(argv, offered, capsys):
    with pytest.raises(SystemExit) as done:
        parse_args(argv)
    assert done.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {argv[0]}: invalid choice: '{argv[1]}'" in error
    assert "(choose from " + ", ".join(f"'{c}'" for c in offered) + ")" in error
    assert "eetq" not in error, "TGI's refused kinds are not offered"
    usage = launcher_parser().format_help()
    assert "{" + ",".join(offered) + "}" in usage, "--help shows the choices"


def test_tgis_values_that_are_refused_still_get_their_reason():
    with pytest.raises(ValueError, match="--quantize eetq is not one of int8, int4, fp8 .* not "
                                         "implemented"):
        parse_args(["--quantize", "eetq"])
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e5m2: no FP8 KV cache"):
        parse_args(["--kv-cache-dtype", "fp8_e5m2"])


def test_a_variable_outside_the_choices_is_refused_by_the_config(monkeypatch):
    monkeypatch.setenv("DEVICE", "mps")
    with pytest.raises(ValueError, match="--device 'mps' is not one of cpu, cuda, auto"):
        parse_args([])


@pytest.mark.parametrize("flag", ["--quantize", "--rope-scaling", "--kv-cache-dtype", "--dtype"])
def test_an_optional_flag_given_empty_is_unset(flag):
    """A script's `--quantize "$QUANTIZE"` with the variable empty: unset, not a refusal."""
    config = parse_args([flag, ""])
    assert getattr(config, flag[2:].replace("-", "_")) in (None, "")
    assert "''" not in launcher_parser().format_help()
