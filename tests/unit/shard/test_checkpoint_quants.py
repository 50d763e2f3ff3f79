"""GPTQ, AWQ, compressed-tensors and FP8 weights read into groups equal their formats' own values."""
import gc
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shard.distributed import ParallelContext
from shard.layers.checkpoint_quants import FloatRows, QuantizedRows
from shard.quant_config import checkpoint_quant
from shard.weights import Weights
from tests.quantized_checkpoints import (pack_awq, pack_compressed, pack_gptq, random_case,
                                         reference, reference_awq, reference_compressed,
                                         reference_gptq, write)

OUT, IN = 64, 256
NAME = "layer.weight"


def _weights(tmp_path, tensors: dict, config: dict, *, rank: int = 0, world_size: int = 1):
    write(tmp_path, {f"layer.{k}": v for k, v in tensors.items()}, config)
    return Weights(tmp_path, dtype=torch.float32, device=torch.device("cpu"),
                   parallel=ParallelContext(rank, world_size),
                   checkpoint_quant=checkpoint_quant({"quantization_config": config}))


def _check(rows: QuantizedRows, expected: np.ndarray, bits: int) -> None:
    """restore() is the reference bit for bit (over the held order of inputs), q in its form's range."""
    expected = torch.from_numpy(expected)
    held = expected if rows.input_order is None else expected[:, rows.input_order]
    assert torch.equal(rows.groups().restore(), held)
    assert torch.equal(rows.dequantize(), expected)
    q = rows.groups().q
    assert q.dtype == torch.int16 and rows.bits == bits and rows.group % 32 == 0
    low, high = (0, 15) if bits == 4 else (-128, 127)
    assert low <= int(q.min()) and int(q.max()) <= high


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128, -1])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_groups_are_autogptqs_dequantization(tmp_path, bits, group, sym, act_order, v1):
    rng = np.random.default_rng(bits * 100 + group)
    case = random_case(rng, OUT, IN, bits=bits, group=group, sym=sym, act_order=act_order)
    tensors = pack_gptq(case, bits, v1=v1, with_g_idx=act_order or group == 32)
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
              "desc_act": act_order, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    weights = _weights(tmp_path, tensors, config)
    rows = weights.get_rows(NAME, 0, OUT, as_stored=True)
    expected = reference_gptq(tensors, bits, group=group, v1=v1)
    if not v1 or not (case.zeros == 0).any():  # v1 cannot store a zero of 0: it reads 2 ** bits
        assert np.array_equal(expected, reference(case))
    _check(rows, expected, bits)
    assert (rows.input_order is not None) == (act_order and group != -1)  # one group: no order
    assert rows.kind == f"GPTQ-{bits}bit-{'channel' if group == -1 else f'g{group}'}"
    assert weights.shape(NAME) == [OUT, IN] and weights.has(NAME)
    assert torch.equal(weights.get(NAME), torch.from_numpy(expected))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_groups_follow_awqs_order_within_each_word(tmp_path, group):
    case = random_case(np.random.default_rng(group), OUT, IN, bits=4, group=group)
    tensors = pack_awq(case)
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}
    rows = _weights(tmp_path, tensors, config).get_rows(NAME, 0, OUT, as_stored=True)
    expected = reference_awq(tensors, group=group)
    assert np.array_equal(expected, reference(case))
    _check(rows, expected, 4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("strategy,group", [("group", 32), ("group", 128), ("channel", -1)])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("scale_dtype", [np.float16, "bfloat16"])
def test_compressed_tensors_groups_are_its_unpacked_values(tmp_path, bits, strategy, group, sym,
                                                           scale_dtype):
    case = random_case(np.random.default_rng(bits + group), OUT, IN, bits=bits, group=group,
                       sym=sym, act_order=strategy == "group" and not sym)
    tensors = pack_compressed(case, bits, sym=sym, with_g_idx=strategy == "group" and not sym)
    if scale_dtype == "bfloat16":
        tensors["weight_scale"] = tensors["weight_scale"].to(torch.bfloat16)
    weights_config = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
                      "group_size": None if group == -1 else group}
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights_config}}}
    rows = _weights(tmp_path, tensors, config).get_rows(NAME, 0, OUT, as_stored=True)
    expected = reference_compressed(tensors, bits, group=group)
    if scale_dtype == np.float16:
        assert np.array_equal(expected, reference(case))
    _check(rows, expected, bits)


def _fp8(rng, out, inputs):
    values = torch.from_numpy(rng.standard_normal((out, inputs)).astype(np.float32) * 50)
    return values.clamp(-448, 448).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_fp8_weights_are_values_times_scales(tmp_path, layout):
    rng = np.random.default_rng(3)
    out, inputs = 200, 300  # blocks of 128 that do not divide the matrix
    weight = _fp8(rng, out, inputs)
    shapes = {"tensor": (), "channel": (out, 1), "block": (2, 3)}
    scale = torch.tensor(rng.random(shapes[layout]).astype(np.float32) + 0.01)
    name = "weight_scale_inv" if layout == "block" else "weight_scale"
    config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if layout == "block":
        config["weight_block_size"] = [128, 128]
    weights = _weights(tmp_path, {"weight": weight, name: scale}, config)
    rows = weights.get_rows(NAME, 0, out, as_stored=True)
    # a scale per element, as each layout says
    per_element = {"tensor": lambda: scale.reshape(1, 1).expand(out, inputs),
                   "channel": lambda: scale.expand(out, inputs),
                   "block": lambda: scale[torch.arange(out) // 128][:, torch.arange(inputs) // 128]}
    expected = weight.float() * per_element[layout]()
    assert isinstance(rows, FloatRows) and rows.bits == 0
    assert torch.equal(rows.dequantize(), expected)

    # a rank's columns (row-parallel) and rows (column-parallel) keep their scales
    assert torch.equal(_weights(tmp_path, {"weight": weight, name: scale}, config, rank=1,
                                world_size=2).get_sharded(NAME, 1, as_stored=True).dequantize(),
                       expected[:, 150:])
    assert torch.equal(weights.get_rows(NAME, 130, 200, as_stored=True).dequantize(),
                       expected[130:])
    # the values are kept as read, but in memory of their own: no mapping of the file outlives
    # the Weights that read it (it would hold every page the load touched)
    del weights
    gc.collect()
    if sys.platform.startswith("linux"):
        maps = Path("/proc/self/maps").read_text()
        assert str((tmp_path / "model.safetensors").resolve()) not in maps
    assert torch.equal(rows.dequantize(), expected)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_a_ranks_columns_of_gptq_keep_their_groups(tmp_path, act_order, world_size):
    """Row-parallel slices: inside groups, across them, and of act-order groups."""
    case = random_case(np.random.default_rng(7), OUT, IN, bits=4, group=128, act_order=act_order)
    tensors = pack_gptq(case, 4)
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": act_order}
    expected = torch.from_numpy(reference_gptq(tensors, 4, group=128))
    width = IN // world_size
    for rank in range(world_size):
        weights = _weights(tmp_path, tensors, config, rank=rank, world_size=world_size)
        part = weights.get_sharded(NAME, 1, as_stored=True)
        assert torch.equal(part.dequantize(), expected[:, rank * width:(rank + 1) * width])
        column = weights.get_sharded(NAME, 0, as_stored=True)
        assert torch.equal(column.dequantize(), expected[rank * OUT // world_size:
                                                         (rank + 1) * OUT // world_size])


def test_a_ranks_columns_of_awq_and_compressed_tensors(tmp_path):
    case = random_case(np.random.default_rng(8), OUT, IN, bits=4, group=64)
    awq = pack_awq(case)
    config = {"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"}
    expected = torch.from_numpy(reference_awq(awq, group=64))
    part = _weights(tmp_path / "awq", awq, config, rank=1, world_size=4).get_sharded(
        NAME, 1, as_stored=True)
    assert torch.equal(part.dequantize(), expected[:, 64:128])
    ct = pack_compressed(case, 4, sym=False)
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "group_size": 64,
                                                  "strategy": "group", "symmetric": False}}}}
    weights = _weights(tmp_path / "ct", ct, config, rank=3, world_size=4)
    expected = torch.from_numpy(reference_compressed(ct, 4, group=64))
    assert torch.equal(weights.get_sharded(NAME, 1, as_stored=True).dequantize(),
                       expected[:, 192:])
    assert torch.equal(weights.get_sharded(NAME, 0, as_stored=True).dequantize(),
                       expected[48:])
