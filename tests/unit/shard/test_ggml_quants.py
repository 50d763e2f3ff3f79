"""Each GGUF block type's groups restore the `gguf` package's dequantization bit for bit."""
import numpy as np
import pytest
import torch

from shard.layers.ggml_quants import BlockRows, groups_of
from shard.layers.ggml_types import BLOCK_TYPES, column_bytes, row_bytes

gguf = pytest.importorskip("gguf")


def _reference(kind: str, data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(
        data, gguf.GGMLQuantizationType[kind]), dtype=np.float32))


def _quantized(kind: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Blocks gguf's own quantizer writes (the types it quantizes), from normal values."""
    values = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    return gguf.quants.quantize(values * 0.05, gguf.GGMLQuantizationType[kind])


def _random_blocks(kind: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Blocks of random bytes with finite float16 factors: every bit pattern the types define."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, row_bytes(kind, columns)), dtype=np.uint8)
    blocks = data.reshape(-1, BLOCK_TYPES[kind].block_bytes)
    halves = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
              "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}[kind]
    for at in halves:
        factors = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, at:at + 2] = factors.view(np.uint8).reshape(-1, 2)
    return data


def _assert_restores(kind: str, data: np.ndarray, columns: int) -> None:
    rows = BlockRows(kind, torch.from_numpy(np.array(data)), columns)
    ours = rows.dequantize()
    expected = _reference(kind, data).reshape(ours.shape)
    assert torch.equal(ours, expected), kind
    groups = rows.groups()
    assert groups.q.shape == (data.shape[0], columns)
    assert groups.scale.shape == (data.shape[0], columns // BLOCK_TYPES[kind].group)
    assert torch.equal(groups.regrouped(16).restore(), expected)


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_random_blocks_restore_gguf_dequantization(kind):
    _assert_restores(kind, _random_blocks(kind, 6, 512, seed=len(kind)), 512)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantized_values_restore_gguf_dequantization(kind):
    _assert_restores(kind, _quantized(kind, 8, 256, seed=3), 256)


def _real_tensors(path, kinds):
    from launcher.gguf_file import read_gguf

    model = read_gguf(path)
    found = {}
    with open(path, "rb") as file:
        for tensor in model.tensors:
            kind = gguf.GGMLQuantizationType(tensor.ggml_type).name
            if kind in kinds and kind not in found and len(tensor.shape) == 2:
                rows = min(tensor.shape[0], 64)
                nbytes = rows * row_bytes(kind, tensor.shape[1])
                file.seek(tensor.offset)
                data = np.frombuffer(file.read(nbytes), dtype=np.uint8)
                found[kind] = (data.reshape(rows, -1), tensor.shape[1])
    return found


@pytest.mark.real_model
def test_real_files_blocks_restore_gguf_dequantization(real_model_dir):
    """SmolLM2's Q4_1 and Q8_0 blocks, Gemma 3 270M's Q4_K, Q5_0, Q6_K and Q8_0."""
    from launcher.known_models import DEFAULT_MODEL, GEMMA3_270M
    from launcher.prepare import fetch_gguf

    cache = real_model_dir.parent.parent
    seen = set()
    for model, kinds in ((DEFAULT_MODEL, {"Q4_1", "Q8_0"}),
                         (GEMMA3_270M, {"Q4_K", "Q5_0", "Q6_K", "Q8_0"})):
        for kind, (data, columns) in _real_tensors(fetch_gguf(model, cache), kinds).items():
            _assert_restores(kind, data, columns)
            seen.add(kind)
    assert seen == {"Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q6_K"}


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole Q4_K blocks"):
        row_bytes("Q4_K", 576)
    with pytest.raises(ValueError, match="split Q4_K blocks"):
        column_bytes("Q4_K", 0, 288)
    with pytest.raises(ValueError, match="bytes each"):
        groups_of("Q8_0", torch.zeros(2, 33, dtype=torch.uint8), 32)


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_compact_factors_restore_the_same_weights(kind):
    """Each type's own factors, widened as the kernels' compact modes widen them, stand for the
    gguf package's dequantization."""
    from shard.layers.ggml_factors import compact_factors

    data = _random_blocks(kind, 4, 512, seed=7)
    rows = BlockRows(kind, torch.from_numpy(np.array(data)), 512)
    factors = compact_factors(rows)
    q, fields = factors.q.float(), factors.fields
    if factors.mode == "half":
        group = 32
        scale = fields["scale"].float()
        low = fields["low"].float() if "low" in fields else torch.zeros_like(scale)
    elif factors.mode == "k":
        group = 32
        scale = fields["d"].repeat_interleave(8, 1) * fields["sc"].float()
        low = -(fields["dmin"].repeat_interleave(8, 1) * fields["m"].float())
    else:
        group = 16
        scale = fields["d"].repeat_interleave(16, 1) * fields["sc"].float()
        low = torch.zeros_like(scale)
    restored = (q.reshape(4, -1, group) * scale[..., None] + low[..., None]).reshape(4, 512)
    assert torch.equal(restored, _reference(kind, data).reshape(4, 512))


def test_a_padded_stack_is_one_part_with_zero_rows():
    """An embedding's rank slice padded to the others' rows: one tensor for every lookup."""
    from shard.layers.ggml_quants import BlockStack

    data = torch.from_numpy(np.array(_random_blocks("Q8_0", 3, 64, seed=1)))
    stack = BlockStack((BlockRows("Q8_0", data[:2], 64), BlockRows("Q8_0", data[2:], 64)))
    padded = stack.padded(5)
    assert len(padded.parts) == 1 and padded.rows == 5
    values = padded.dequantize()
    assert torch.equal(values[:3], stack.dequantize()) and not values[3:].any()
    assert torch.equal(padded.take(torch.tensor([2, 4])).dequantize()[0], values[2])
