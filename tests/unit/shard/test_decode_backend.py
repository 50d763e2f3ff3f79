"""Which kernel reads the paged cache at decode, for each device, cache dtype and installation."""
import sys

import pytest
import torch

import shard.kernels
from shard.kernels import decode_backend, paged_attention, triton_shapes

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.fixture
def fresh(monkeypatch):
    """decode_backend's cached import undone before and after the test."""
    decode_backend.triton_kernel.cache_clear()
    yield monkeypatch
    decode_backend.triton_kernel.cache_clear()


def test_cuda_takes_triton_where_it_imports_for_every_cache_it_reads(fresh):
    pytest.importorskip("triton")
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int8):
        assert decode_backend.select(CUDA, dtype) == decode_backend.TRITON
    assert decode_backend.select(CUDA, torch.float8_e4m3fn) is None  # a cache it does not read


def test_without_triton_cuda_keeps_pytorchs_gather(fresh):
    fresh.setitem(sys.modules, "triton", None)  # what a CPU build of PyTorch leaves: no Triton
    fresh.delitem(sys.modules, "shard.kernels.triton_attention", raising=False)
    fresh.delattr(shard.kernels, "triton_attention", raising=False)
    assert decode_backend.triton_kernel() is None
    assert decode_backend.select(CUDA, torch.bfloat16) is None


def test_the_variable_turns_triton_off(fresh):
    fresh.setenv(decode_backend.TRITON_ENV, "0")
    assert decode_backend.select(CUDA, torch.bfloat16) is None


def test_cpus_take_the_c_kernel_and_other_devices_neither(fresh):
    expected = decode_backend.C if paged_attention.load_kernel() is not None else None
    assert decode_backend.select(CPU, torch.bfloat16) == expected
    assert decode_backend.select(CPU, torch.float16) is None  # the C kernel reads no float16
    assert decode_backend.select(torch.device("mps"), torch.float16) is None


def test_cpu_tensors_go_to_the_c_kernel_whatever_else_is_installed(fresh):
    calls = []
    fresh.setattr(paged_attention, "paged_decode_attention",
                  lambda *args, **options: calls.append(options) or "c")
    assert decode_backend.paged_decode_attention(torch.zeros(1, 2, 4), None, None, None, None,
                                                 0.5, window=3) == "c"
    assert calls == [{"window": 3}]


def test_splits_fill_the_gpu_only_where_few_programs_read_long_contexts():
    wanted = 264  # two programs on each of an H100's 132 multiprocessors
    # one stream of Llama 3 8B's 8 key/value heads over 8,192 tokens: 33 wanted, 32 at most
    assert triton_shapes.decode_splits(1, 8, 8192, wanted) == triton_shapes.MAX_SPLITS
    # over 2,048 tokens: no share under 256 tokens
    assert triton_shapes.decode_splits(1, 8, 2048, wanted) == 8
    # four streams: 32 programs, 9 splits keep 288 busy
    assert triton_shapes.decode_splits(4, 8, 4096, wanted) == 9
    # enough programs already, or contexts too short to share
    assert triton_shapes.decode_splits(64, 8, 8192, wanted) == 1
    assert triton_shapes.decode_splits(1, 8, 300, wanted) == 1
    assert triton_shapes.decode_splits(1, 8, 0, wanted) == 1


def test_the_programs_wanted_off_cuda_are_a_default_gpus():
    assert triton_shapes.programs_wanted(CPU) == (triton_shapes.PROGRAMS_PER_SM
                                                   * triton_shapes.DEFAULT_SMS)


def test_prefill_reads_in_place_where_decode_runs_triton(fresh):
    pytest.importorskip("triton")
    kernel = decode_backend.prefill_kernel(CUDA, torch.bfloat16)
    assert kernel.__name__ == "shard.kernels.triton_prefill"
    assert decode_backend.prefill_kernel(CUDA, torch.int8) is kernel
    assert decode_backend.prefill_kernel(CUDA, torch.float8_e4m3fn) is None
    assert decode_backend.prefill_kernel(CPU, torch.bfloat16) is None  # the CPU's paths stay
    fresh.setenv(decode_backend.TRITON_ENV, "0")
    decode_backend.triton_kernel.cache_clear()
    assert decode_backend.prefill_kernel(CUDA, torch.bfloat16) is None


def test_an_int8_cache_is_read_where_c_or_triton_reads_it_and_refused_elsewhere():
    refusal = decode_backend.cache_refusal
    off = {"compile_decode": False, "cuda_graphs": False}
    # Triton on CUDA reads it in decode, prefill and the graphs over them
    assert refusal(CUDA, torch.int8, decode_backend.TRITON, compile_decode=False,
                   cuda_graphs=True) is None
    assert "Triton does not import" in refusal(CUDA, torch.int8, None, **off)
    assert refusal(CPU, torch.int8, decode_backend.C, **off) is None
    # graphs that gather each context, or the compiled step, do not read its scales
    assert "CUDA graphs" in refusal(CPU, torch.int8, decode_backend.C, compile_decode=False,
                                    cuda_graphs=True)
    assert "--compile-decode" in refusal(CUDA, torch.int8, decode_backend.TRITON,
                                         compile_decode=True, cuda_graphs=False)
    assert "not on mps" in refusal(torch.device("mps"), torch.int8, None, **off)
    for dtype in (torch.bfloat16, torch.float16):  # the model's own dtype: read everywhere
        assert refusal(CUDA, dtype, None, compile_decode=True, cuda_graphs=True) is None
