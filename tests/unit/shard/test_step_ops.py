"""What one plain decode step runs, as CUDA runs it: one read back to the host, one dtype copy.

A plain step: greedy rows beside sampling rows (temperature, top-k, top-p, seeded), no
log-probabilities, grammar or stop sequence asked. On CUDA a value read back to the host (.item(),
.tolist(), a boolean mask's nonzero) waits for every kernel queued before it, and a dtype copy is
a kernel and a tensor of its own. A dispatch mode records every PyTorch op of one such step of a
tiny bf16 Llama and Gemma 2 (soft-capped) on the CPU, through the eager path CUDA takes: its
kernels (the norms and the rotary cache write in Triton, run by its interpreter; attention reading
the cache in place, the C kernel standing for Triton's; the matmuls) each count as one op,
whatever they run inside. Where Triton does not run, the norms' PyTorch forms convert each norm's
rows to float32 and back: that bound is held too.
"""
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from shard.decode_paths import c_step
from shard.kernels import decode_backend, layer_ops, paged_attention
from shard.layers import embedding, linear, precision
from shard.model_runner import DecodePath
from tests.engine_helpers import BlockPool, make_engine, request

# ops that read a device value on the host (a boolean index's nonzero is checked apart)
READS_BACK = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.nonzero_static",
              "aten.masked_select", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim"}
NORMS = {"llama": 3 * 2 + 1, "gemma2": 3 * 4 + 1}  # per layer, and the final one
VOCAB = 320

needs_c_kernel = pytest.mark.skipif(paged_attention.load_kernel() is None,
                                    reason="the C paged kernel stands for Triton's attention")


class StepOps(TorchDispatchMode):
    """The ops a step dispatches that read a device value on the host, or change a dtype."""

    def __init__(self):
        super().__init__()
        self.host_reads: list[str] = []
        self.casts: list[str] = []
        self.kernels: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        indices = args[1] if name.startswith("aten.index") and len(args) > 1 else ()
        if name in READS_BACK or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                     for i in indices or ()):
            self.host_reads.append(name)
        if (name in ("aten._to_copy", "aten.to") and out is not args[0]
                and out.dtype != args[0].dtype):
            self.casts.append(f"{args[0].dtype} -> {out.dtype} {tuple(out.shape)}")
        return out

    def kernel(self, name: str, function):
        """`function` run as one kernel launch: its own ops are not recorded."""
        def launch(*args, **kwargs):
            self.kernels[name] += 1
            with _disable_current_modes():
                return function(*args, **kwargs)
        return launch


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    from tests.parity.test_gemma_parity import build_tiny_gemma

    return build_tiny_gemma(tmp_path_factory.mktemp("gemma2"), 2)


def _plain_step(monkeypatch, model_dir, ops: StepOps, *, triton) -> list[str]:
    """One plain decode step of three rows (a greedy one, two seeded sampling ones) in `ops`.

    `triton`: the layer ops' Triton kernels, else their PyTorch forms (the C ones left out).
    Returns the modules that read a tensor's values with .tolist()."""
    # bf16 activations, as on CUDA, on any CPU; the eager step, not the C one
    monkeypatch.setattr(precision, "cpu_has_bf16_kernels", lambda: True)
    monkeypatch.setattr(precision, "c_matmul_runs", lambda: False)
    monkeypatch.setattr(c_step, "unsupported_reason", lambda *_: "the eager step is measured")
    monkeypatch.setattr(layer_ops, "_fused", lambda *_: None)
    monkeypatch.setattr(layer_ops, "_on_cuda", lambda _: triton)
    for module in (linear, embedding):
        monkeypatch.setattr(module, "linear", ops.kernel("matmul", linear.linear))
    monkeypatch.setattr(decode_backend, "paged_decode_attention",
                        ops.kernel("attention", decode_backend.paged_decode_attention))
    engine = make_engine(model_dir, dtype=torch.bfloat16, num_blocks=64)
    pool = BlockPool(64)
    params = [{}, {"do_sample": True, "seed": 3, "temperature": 0.7, "top_k": 20, "top_p": 0.9},
              {"do_sample": True, "seed": 4}]
    out = engine.prefill(1, [request(i, [5, 6, 7 + i, 8], pool.take(12, 4), max_new_tokens=8,
                                     ignore_eos=True, **p) for i, p in enumerate(params)])
    out = engine.decode([out.batch.id])  # lazy set-ups (kernel builds, caches) happen here
    assert engine.runner.decode_path(3) is DecodePath.EAGER
    readers = []
    tolist = torch.Tensor.tolist

    def read(tensor):
        readers.append(sys._getframe(1).f_globals["__name__"])
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", read)
    ops.kernels.clear()
    with ops:
        engine.decode([out.batch.id])
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return readers


@pytest.fixture(params=["llama", "gemma2"])
def model(request, tiny_llama, tiny_gemma2):
    return request.param, {"llama": tiny_llama, "gemma2": tiny_gemma2}[request.param]


@needs_c_kernel
def test_a_plain_step_reads_its_tokens_once_and_converts_only_its_logits(
        monkeypatch, model, triton_layer_ops):
    if triton_layer_ops.device != "cpu":
        pytest.skip("interpreted only: on a GPU the layer ops take CUDA tensors")
    name, model_dir = model
    ops = StepOps()
    triton = type("Triton", (), {
        "rms_norm": staticmethod(ops.kernel("norm", triton_layer_ops.rms_norm)),
        "rotary_store": staticmethod(ops.kernel("rotary", triton_layer_ops.rotary_store))})
    readers = _plain_step(monkeypatch, model_dir, ops, triton=triton)
    assert ops.host_reads == []
    # every value read on the host is the step's one read of its tokens (shard.host_reads)
    assert set(readers) == {"shard.host_reads"}
    # the logits' float32 for sampling (a soft cap then computes in it), no other conversion
    assert ops.casts == [f"torch.bfloat16 -> torch.float32 (3, {VOCAB})"]
    # every norm (Gemma's float32-weighted ones too) and rotary cache write was one launch
    assert ops.kernels["norm"] == NORMS[name] and ops.kernels["rotary"] == 3


@needs_c_kernel
def test_without_triton_each_norm_converts_its_rows_once_each_way(monkeypatch, model):
    name, model_dir = model
    ops = StepOps()
    readers = _plain_step(monkeypatch, model_dir, ops, triton=None)
    assert ops.host_reads == [] and set(readers) == {"shard.host_reads"}
    assert len(ops.casts) == 2 * NORMS[name] + 1, ops.casts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [None, "auto"], ids=["eager", "graphs"])
def test_on_a_gpu_a_plain_step_waits_for_the_device_once(tiny_llama, graphs):
    """CUDA's own count: every synchronizing call of one plain step, eager and replayed."""
    import warnings

    engine = make_engine(tiny_llama, device="cuda", dtype=torch.bfloat16, num_blocks=64,
                         cuda_graphs=graphs, max_total_tokens=48 if graphs else 0)
    pool = BlockPool(64)
    params = [{}, {"do_sample": True, "seed": 3, "temperature": 0.7, "top_k": 20, "top_p": 0.9},
              {"do_sample": True, "seed": 4}]
    out = engine.prefill(1, [request(i, [5, 6, 7 + i, 8], pool.take(12, 4), max_new_tokens=8,
                                     ignore_eos=True, **p) for i, p in enumerate(params)])
    out = engine.decode([out.batch.id])
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.decode([out.batch.id])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # the first use of the mode also warns that it is a prototype: not a synchronization
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, syncs  # shard.host_reads' one wait for the step's results
