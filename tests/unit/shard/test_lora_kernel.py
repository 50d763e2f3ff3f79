"""The C LoRA kernel (shard/kernels/lora.c) against float64 arithmetic, and a row's bits independent
of its batch and of the thread count."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shard.config import CACHE_ENV, KERNEL_MARCH_ENV
from shard.kernels import lora

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(params=["native", "avx2", "portable"])
def lora_build(request, tmp_path_factory, monkeypatch):
    """The kernel as this CPU builds it, as an AVX2-only CPU does (-march=x86-64-v3), and without
    vector instructions (-march=x86-64: its one-lane form)."""
    if request.param == "avx2":
        request.getfixturevalue("avx2_build")
    elif request.param == "portable":
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip("-march=x86-64 is an x86 build")
        monkeypatch.setenv(KERNEL_MARCH_ENV, "x86-64")
        monkeypatch.setenv(CACHE_ENV, str(tmp_path_factory.getbasetemp() / "portable-kernels"))
    lora.load_library.cache_clear()
    if lora.load_library() is None:
        lora.load_library.cache_clear()
        pytest.skip("the C LoRA kernel needs a C compiler")
    yield request.param
    lora.load_library.cache_clear()


def _stacks(slots: int, rank: int, inputs: int, width: int, ranks: list[int], seed: int):
    """a [slots, rank, inputs], bt [slots, rank, width] (zeros past each slot's rank, as the
    adapter set keeps them) and ranks [slots]."""
    generator = torch.Generator().manual_seed(seed)
    a = (torch.randn(slots, rank, inputs, generator=generator) / inputs ** 0.5).bfloat16()
    bt = torch.randn(slots, rank, width, generator=generator).bfloat16()
    for s, r in enumerate(ranks):
        a[s, r:] = 0
        bt[s, r:] = 0
    return a, bt, torch.tensor(ranks, dtype=torch.int64)


def _exact(x, out, slots, a, bt, ranks, offset, width) -> torch.Tensor:
    """out's part columns plus each row's update, in float64 (not rounded)."""
    part = out[:, offset:offset + width].double().clone()
    for i, s in enumerate(slots.tolist()):
        if 0 <= s < a.shape[0] and ranks[s] > 0:
            r = int(ranks[s])
            part[i] += (x[i].double() @ a[s, :r].double().T) @ bt[s, :r].double()
    return part


def _assert_within_bf16(got: torch.Tensor, exact: torch.Tensor) -> None:
    """Within one bf16 unit of the exact result (float32 sums, rounded once), or of the sums'
    float32 error where they cancel to almost nothing."""
    unit = exact.abs() * 2.0 ** -7
    error = (got.double() - exact).abs()
    assert torch.all(error <= unit + 1e-4), error.max()


@pytest.mark.parametrize("rows", [1, 7, 33, 300])
@pytest.mark.parametrize("ranks", [[1, 1], [8, 8], [64, 64], [64, 0, 8, 3, 17]],
                         ids=["rank1", "rank8", "rank64", "mixed"])
def test_each_row_gets_its_own_adapters_update(rows, ranks, lora_build):
    """Slots of every rank (0: that slot's adapter does not touch this part), rows of no slot
    (-1) or one past the stacks left alone, inputs and widths with partial vector steps, a
    strided x and a part in the middle of the layer's output."""
    inputs, width, offset = 200, 136, 24
    a, bt, rank_of = _stacks(len(ranks), max(ranks), inputs, width, ranks, seed=rows)
    generator = torch.Generator().manual_seed(rows + 1)
    slots = torch.randint(-1, len(ranks) + 1, (rows,), generator=generator)
    slots[0] = 0
    wide = torch.randn(rows, inputs + 40, generator=generator).bfloat16()
    x = wide[:, 16:16 + inputs]  # rows 240 apart
    out = torch.randn(rows, offset + width + 8, generator=generator).bfloat16()
    before = out.clone()
    lora.add(x, out, slots, a, bt, rank_of, offset, width)
    updated = torch.tensor([0 <= s < len(ranks) and ranks[s] > 0 for s in slots.tolist()])
    assert torch.equal(out[:, :offset], before[:, :offset])
    assert torch.equal(out[:, offset + width:], before[:, offset + width:])
    assert torch.equal(out[~updated], before[~updated])
    _assert_within_bf16(out[:, offset:offset + width],
                        _exact(x, before, slots, a, bt, rank_of, offset, width))
    assert not torch.equal(out[updated], before[updated])


@pytest.mark.parametrize("inputs,width", [(576, 960), (96, 40), (131, 77)])
def test_a_rows_bits_do_not_depend_on_its_batch(inputs, width, lora_build):
    """Each row of a large mixed batch alone, in the batch, and in the batch reversed (other tiles,
    other items, other threads): the same bits."""
    ranks = [16, 64, 0, 5, 1]
    a, bt, rank_of = _stacks(len(ranks), 64, inputs, width, ranks, seed=inputs)
    generator = torch.Generator().manual_seed(width)
    rows = 300
    slots = torch.randint(-1, len(ranks), (rows,), generator=generator)
    x = torch.randn(rows, inputs, generator=generator).bfloat16()
    out = torch.randn(rows, width, generator=generator).bfloat16()
    batched = out.clone()
    lora.add(x, batched, slots, a, bt, rank_of, 0, width)
    flipped = out.flip(0).clone()
    lora.add(x.flip(0).contiguous(), flipped, slots.flip(0).contiguous(), a, bt, rank_of, 0,
             width)
    assert torch.equal(flipped.flip(0), batched)
    for i in range(0, rows, 7):
        alone = out[i:i + 1].clone()
        lora.add(x[i:i + 1], alone, slots[i:i + 1], a, bt, rank_of, 0, width)
        assert torch.equal(alone, batched[i:i + 1]), i


_RUN_WITH_THREADS = """
import sys, torch
from shard.kernels import lora
inputs = torch.load(sys.argv[1])
out = inputs["out"].clone()
lora.add(inputs["x"], out, inputs["slots"], inputs["a"], inputs["bt"], inputs["ranks"], 0,
         inputs["out"].shape[1])
torch.save(out, sys.argv[2])
"""


def test_the_thread_count_does_not_change_a_bit(tmp_path):
    """The same batches on 1, 2 and 3 OpenMP threads (separate processes: the team's size is
    fixed in each), large enough to run in parallel."""
    if lora.load_library() is None:
        pytest.skip("the C LoRA kernel needs a C compiler")
    ranks = [64, 16, 3]
    results = {}
    for rows in (2, 40):
        a, bt, rank_of = _stacks(len(ranks), 64, 576, 1000, ranks, seed=rows)
        generator = torch.Generator().manual_seed(rows)
        inputs = {"x": torch.randn(rows, 576, generator=generator).bfloat16(),
                  "out": torch.randn(rows, 1000, generator=generator).bfloat16(),
                  "slots": torch.randint(-1, len(ranks), (rows,), generator=generator),
                  "a": a, "bt": bt, "ranks": rank_of}
        torch.save(inputs, tmp_path / f"inputs-{rows}.pt")
        for threads in (1, 2, 3):
            subprocess.run([sys.executable, "-c", _RUN_WITH_THREADS, tmp_path / f"inputs-{rows}.pt",
                            tmp_path / f"out-{rows}-{threads}.pt"], cwd=ROOT, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": str(threads)})
            results[rows, threads] = torch.load(tmp_path / f"out-{rows}-{threads}.pt")
        assert not torch.equal(results[rows, 1], inputs["out"])
        assert torch.equal(results[rows, 1], results[rows, 2])
        assert torch.equal(results[rows, 1], results[rows, 3])


def test_tensors_that_do_not_fit_are_refused():
    if lora.load_library() is None:
        pytest.skip("the C LoRA kernel needs a C compiler")
    a, bt, ranks = _stacks(2, 8, 64, 32, [8, 4], seed=0)
    x, out = torch.zeros(3, 64).bfloat16(), torch.zeros(3, 48).bfloat16()
    slots = torch.zeros(3, dtype=torch.int64)
    lora.add(x, out, slots, a, bt, ranks, 16, 32)
    refused = [
        (x.float(), out, slots, a, bt, ranks, 0, 32),  # not bf16
        (x, out, slots.int(), a, bt, ranks, 0, 32),  # slots not int64
        (x[:, :32], out, slots, a, bt, ranks, 0, 32),  # inputs != a's
        (x[:2], out, slots, a, bt, ranks, 0, 32),  # rows disagree
        (x, out, slots[:2], a, bt, ranks, 0, 32),
        (x, out, slots, a, bt, ranks, 17, 32),  # past out's columns
        (x, out, slots, a, bt, ranks, -1, 32),
        (x, out, slots, a, bt, ranks, 0, 16),  # width != bt's
        (x, out.T.contiguous().T, slots, a, bt, ranks, 0, 32),  # out's columns strided
        (x, out, slots, a.transpose(1, 2).contiguous().transpose(1, 2), bt, ranks, 0, 32),
        (x, out, slots, a, bt, ranks[:1], 0, 32),
        (x.unsqueeze(0), out, slots, a, bt, ranks, 0, 32),
    ]
    for args in refused:
        with pytest.raises(ValueError):
            lora.add(*args)


def test_switched_off_the_kernel_does_not_load(monkeypatch):
    monkeypatch.setenv(lora.ENABLED_ENV, "0")
    lora.load_library.cache_clear()
    try:
        assert lora.load_library() is None
    finally:
        lora.load_library.cache_clear()
