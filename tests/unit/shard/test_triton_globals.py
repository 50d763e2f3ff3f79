"""Triton kernels read no plain module globals: the interpreter allows them, a GPU build does not."""
import importlib
import pkgutil
import types

import pytest

tl = pytest.importorskip("triton.language")

import shard.kernels  # noqa: E402


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def test_every_global_a_kernel_reads_is_a_constexpr_a_function_or_a_module():
    plain = []
    for info in pkgutil.iter_modules(shard.kernels.__path__):
        if not info.name.startswith("triton_"):
            continue
        module = importlib.import_module(f"shard.kernels.{info.name}")
        for name, value in vars(module).items():
            kernel = getattr(value, "fn", None)  # a JITFunction, or the interpreter's wrapper
            if not isinstance(kernel, types.FunctionType) or kernel.__module__ != module.__name__:
                continue
            for used in _code_names(kernel.__code__):
                seen = vars(module).get(used)
                if isinstance(seen, (int, float, bool, str)) and not isinstance(seen, tl.constexpr):
                    plain.append(f"{info.name}.{name} reads {used}")
    assert plain == []
