"""A GGUF converted as stored (launcher's "gguf" conversion) serves the weights its blocks hold."""
import gc
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from launcher.gguf import convert_gguf
from shard.distributed import ParallelContext
from shard.layers.ggml_quants import BlockRows
from shard.layers.ggml_types import BLOCKS_KEY
from shard.loader import load_model
from shard.quantization_report import describe, served_types
from shard.weights import Weights
from tests.engine_helpers import prefill_logits
from tests.unit.launcher.tiny_gguf import write_tiny_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    tiny = write_tiny_gguf(root / "tiny.gguf")
    native = convert_gguf(tiny.path, root / "native", dtype="gguf")
    widened = convert_gguf(tiny.path, root / "float32", dtype="float32")
    return tiny, native, widened


def test_blocks_are_written_as_stored_and_floats_in_their_dtype(converted):
    tiny, native, _ = converted
    config = json.loads((native / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "gguf", "file_type": "", "dequantized": {},
        "tensor_types": {kind: sum(t == kind for t in tiny.types.values())
                         for kind in ("Q4_1", "Q8_0")}}
    with safe_open(str(native / "model.safetensors"), framework="pt") as handle:
        blocks = json.loads(handle.metadata()[BLOCKS_KEY])
        for name, kind in tiny.types.items():
            stored = handle.get_slice(name).get_dtype()
            if kind in ("Q4_1", "Q8_0"):
                assert blocks[name] == [kind, tiny.expected[name].shape[1]] and stored == "U8"
            else:
                assert name not in blocks and stored == kind
    weights = Weights(native, dtype=torch.float32, device=torch.device("cpu"),
                      parallel=ParallelContext())
    for name, expected in tiny.expected.items():
        assert torch.equal(weights.get(name), torch.from_numpy(expected)), name
        assert weights.shape(name) == list(expected.shape)
        if name in weights.blocks:
            assert isinstance(weights.get_rows(name, 1, 3, as_stored=True), BlockRows)


def test_float32_shards_serve_the_blocks_values_exactly(converted):
    _, native, widened = converted
    loaded, ours = prefill_logits(native, torch.float32)
    _, expected = prefill_logits(widened, torch.float32)
    assert torch.equal(ours, expected)
    served = served_types(loaded.model)
    assert set(served) == {"Q4_1", "Q8_0"} and "embedding lookup" in served["Q8_0"]
    assert describe(loaded.model, loaded.quantization_config, None).startswith("gguf: Q4_1 in ")


def test_bf16_shards_stay_within_bf16_rounding_of_the_float32_model(converted):
    _, native, widened = converted
    _, ours = prefill_logits(native, torch.bfloat16)
    _, bf16 = prefill_logits(widened, torch.bfloat16)
    _, expected = prefill_logits(widened, torch.float32)
    # the blocks' own weights (exact) against bf16-rounded ones: no further from float32
    assert (ours - expected).abs().max() <= 2 * (bf16 - expected).abs().max() + 1e-2


def test_a_type_not_served_as_stored_is_dequantized_with_a_log_line(caplog):
    """Q2_K (and the other types the kernels do not take) are written as bf16, said by name; a
    stack of experts is written one matrix per expert, each as stored."""
    import gguf

    from launcher.gguf import _native_spec
    from launcher.gguf_file import TensorInfo

    kind = gguf.GGMLQuantizationType.Q2_K
    tensor = TensorInfo("blk.0.ffn_down.weight", (64, 256), int(kind), 0, 64 * 84)
    with caplog.at_level("INFO", logger="tgi.launcher"):
        spec, blocks = _native_spec("model.layers.0.mlp.down_proj.weight", tensor, 0.0)
    assert (spec.dtype, spec.shape, blocks) == ("BF16", (64, 256), "")
    assert "blk.0.ffn_down.weight: Q2_K is not served as stored" in caplog.text
    experts = TensorInfo("blk.0.ffn_up_exps.weight", (4, 64, 256),
                         int(gguf.GGMLQuantizationType.Q4_K), 0, 0)
    assert _native_spec("expert", experts, 0.0, (64, 256)) == (
        type(spec)("expert", (64, 144), "U8"), "Q4_K")
    with caplog.at_level("INFO", logger="tgi.launcher"):
        assert _native_spec("experts", experts, 0.0)[0].dtype == "BF16"
    assert "ffn_up_exps.weight: a 3-D tensor is not served as stored" in caplog.text
    q4 = TensorInfo("blk.0.ffn_up.weight", (64, 256), int(gguf.GGMLQuantizationType.Q4_K), 0, 0)
    assert _native_spec("up", q4, 0.0) == (type(spec)("up", (64, 144), "U8"), "Q4_K")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_loaded_model_holds_no_page_of_its_file(converted):
    """Tensors kept as read (GGUF blocks for lookups, float32 served as float32) are copies: the
    file's mapping, whose every page the load touched, is let go rather than counted again."""
    _, native, widened = converted
    for model_dir, dtype in ((native, torch.bfloat16), (widened, torch.float32)):
        loaded = load_model(model_dir, dtype=dtype, device=torch.device("cpu"),
                            parallel=ParallelContext())
        gc.collect()
        file = str((model_dir / "model.safetensors").resolve())
        assert file not in Path("/proc/self/maps").read_text(), model_dir.name
        del loaded


def test_a_tied_heads_int8_form_serves_the_lookups_and_the_blocks_go(tmp_path):
    """A tied Q8_0 matrix is held once: the head's int8 kernel form, whose rows the embedding
    reads (the values GGUF dequantizes, exactly); where no kernel runs, the blocks serve both."""
    from shard.layers.linear import c_int8_runs

    tiny = write_tiny_gguf(tmp_path / "tied.gguf", with_output=False)
    native = convert_gguf(tiny.path, tmp_path / "native", dtype="gguf")
    expected = torch.from_numpy(tiny.expected["model.embed_tokens.weight"])
    for dtype in (torch.bfloat16, torch.float32):
        loaded = load_model(native, dtype=dtype, device=torch.device("cpu"),
                            parallel=ParallelContext())
        embedding = loaded.model.embed_tokens
        shared = dtype == torch.bfloat16 and c_int8_runs()
        assert (embedding.blocks is None) == shared and (embedding.head_form is not None) == shared
        ids = torch.tensor([[3, 0, expected.shape[0] - 1], [7, 7, 1]])
        assert torch.equal(embedding(ids), expected[ids].to(dtype))
        assert "embedding lookup" in served_types(loaded.model)["Q8_0"]
