"""Fixtures for shard layers whose arithmetic depends on the CPU."""
import importlib
import os
import platform

import pytest
import torch

from shard.config import KERNEL_MARCH_ENV
from shard.kernels import native
from shard.layers import precision


@pytest.fixture(params=[True, False], ids=["native-bf16", "widened-bf16"])
def bf16_kernels(request, monkeypatch) -> bool:
    """Forces the CPU-capability decision both ways on any machine: "native-bf16" runs the branch an
    AVX-512 BF16 / AMX CPU takes (PyTorch computes bf16 correctly, if slowly, everywhere), and
    "widened-bf16" the branch of an AVX2 CPU without our C matmul, which computes bf16 data in
    float32. Only the dtype decisions of shard.layers.precision are forced; the oneDNN weight
    prepack needs the real instructions."""
    monkeypatch.setattr(precision, "cpu_has_bf16_kernels", lambda: request.param)
    if not request.param:  # nor our C matmul, which would keep bf16 activations on AVX2
        monkeypatch.setattr(precision, "c_matmul_runs", lambda: False)
    return request.param


@pytest.fixture
def avx2_build(tmp_path_factory, monkeypatch):
    """Every C kernel built from here on as an AVX2-only CPU builds it (-march=x86-64-v3), on any
    CPU that runs AVX2, into one cache for the session; callers clear their libraries' caches."""
    if platform.machine() not in ("x86_64", "AMD64") or not (
            {"avx2", "fma"} <= set(native.cpu_flags().split())):
        pytest.skip("this CPU cannot run an AVX2 build")
    monkeypatch.setenv(KERNEL_MARCH_ENV, "x86-64-v3")
    monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path_factory.getbasetemp() / "avx2-kernels"))


@pytest.fixture
def no_vnni_build(tmp_path_factory, monkeypatch):
    """Every C kernel built from here on as an AVX-512 BF16 CPU without VNNI would build it (the
    int4 and int8 kernels' int16 tiles and unpacked blocks), on a CPU that has both."""
    if not {"avx512_bf16", "avx512_vnni"} <= set(native.cpu_flags().split()):
        pytest.skip("this CPU builds no AVX-512 BF16 form without VNNI but its own")
    monkeypatch.setenv(KERNEL_MARCH_ENV, "native -mno-avx512vnni")
    monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path_factory.getbasetemp() / "no-vnni"))


@pytest.fixture(params=["native", "avx2", "avx-vnni"])
def integer_build(request, tmp_path_factory, monkeypatch):
    """Each build whose int4 and int8 kernels multiply in integers, by name.

    As this CPU builds them, as an AVX2-only CPU does (-march=x86-64-v3), and as one with AVX-VNNI
    but no AVX-512 does (-march=alderlake). Load a kernel in it with
    tests.kernel_builds.integer_library."""
    if request.param == "avx2":
        request.getfixturevalue("avx2_build")
    elif request.param == "avx-vnni":
        if not {"avx2", "fma", "f16c", "avx_vnni"} <= set(native.cpu_flags().split()):
            pytest.skip("this CPU cannot run an AVX-VNNI build")
        monkeypatch.setenv(KERNEL_MARCH_ENV, "alderlake")
        monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path_factory.getbasetemp() / "avx-vnni"))
    return request.param


class _KernelOn:
    """A kernel module's functions run on `device`, taking and giving CPU tensors."""

    def __init__(self, module, device: str):
        self.module, self.device = module, device

    def __getattr__(self, name):
        function = getattr(self.module, name)

        def move(x):
            return x.to(self.device) if isinstance(x, torch.Tensor) else x

        def on_device(*args, **options):
            out = function(*map(move, args), **{k: move(v) for k, v in options.items()})
            if isinstance(out, tuple):
                return tuple(o.cpu() for o in out)
            return None if out is None else out.cpu()

        return on_device


def _triton_module(name: str) -> _KernelOn:
    """shard.kernels.`name` on CPU tensors: run by Triton's interpreter, or compiled on a GPU (the
    tensors moved there and back).

    Skips where Triton is not installed. tests/conftest.py sets the interpreter up on machines
    without CUDA, before anything imports Triton."""
    pytest.importorskip("triton")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not interpreted and not torch.cuda.is_available():
        pytest.skip("Triton was imported before its interpreter was asked for")
    module = importlib.import_module(f"shard.kernels.{name}")
    return _KernelOn(module, "cpu" if interpreted else "cuda")


@pytest.fixture
def triton_kernel():
    """shard.kernels.triton_attention, decode attention (see _triton_module)."""
    return _triton_module("triton_attention")


@pytest.fixture
def triton_layer_ops():
    """shard.kernels.triton_layer_ops, the norm and the rotary cache write (see _triton_module)."""
    return _triton_module("triton_layer_ops")


@pytest.fixture
def triton_sampling():
    """shard.kernels.triton_sampling, the sampling rows' draw (see _triton_module)."""
    return _triton_module("triton_sampling")


@pytest.fixture
def triton_prefill():
    """shard.kernels.triton_prefill, prefill attention (see _triton_module)."""
    return _triton_module("triton_prefill")
