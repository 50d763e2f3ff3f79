"""GGUF files of Gemma 2/3 and Qwen 2/3 convert into the Hugging Face model they were made from:
names, Gemma's norms back from 1 + weight, no rope permutation, and a config.json that makes
transformers run the same model (sliding layers, rope bases, query scale, softcaps, end of turn)."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from launcher import gguf as conversion
from launcher.gguf import GGUFError, convert_gguf, write_model_files
from launcher.gguf_architectures import Metadata, _layer_types, _query_pre_attn_scalar
from tests.unit.launcher.tiny_arch_gguf import HEAD_DIM, TURN_END, WINDOW, write_arch_gguf

gguf = pytest.importorskip("gguf")

CLASSES = {"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@pytest.fixture(scope="module", params=sorted(CLASSES))
def converted(request, tmp_path_factory):
    """(the tiny GGUF, its float32 conversion), slices of 16 rows at a time."""
    tmp = tmp_path_factory.mktemp(request.param)
    tiny = write_arch_gguf(tmp / f"{request.param}.gguf", request.param)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conversion, "CHUNK_ELEMENTS", 16 * 64)
        out = convert_gguf(tiny.path, tmp / "model", dtype="float32")
    return tiny, out


def test_every_weight_is_the_one_the_gguf_was_made_from(converted):
    tiny, out = converted
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(tiny.expected)
    for name, expected in tiny.expected.items():
        assert torch.equal(weights[name], torch.from_numpy(expected)), (name, tiny.types[name])


def test_transformers_runs_the_converted_directory_as_the_original_model(converted):
    import transformers

    tiny, out = converted
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CLASSES[tiny.path.stem]]
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(ours).__name__ == CLASSES[tiny.path.stem]
    # longer than the sliding window, so that the local layers' window shows
    prompt = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 11, 60, 61, 62, 63]])
    assert prompt.shape[1] > 2 * WINDOW
    with torch.no_grad():
        expected = tiny.model(prompt).logits
        logits = ours(prompt).logits
    assert (logits - expected).abs().max().item() <= 1e-5


def test_gemma3_config_matches_its_metadata(tmp_path):
    tiny = write_arch_gguf(tmp_path / "gemma3.gguf", "gemma3")
    (tmp_path / "out").mkdir()
    config = write_model_files(tiny.path, tmp_path / "out")
    assert config["model_type"] == "gemma3_text" and config["torch_dtype"] == "bfloat16"
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["sliding_window"] == WINDOW and config["head_dim"] == HEAD_DIM
    assert config["query_pre_attn_scalar"] == HEAD_DIM
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1000000.0, 10000.0)
    assert config["hidden_activation"] == "gelu_pytorch_tanh"
    assert config["attn_logit_softcapping"] is None and config["final_logit_softcapping"] is None
    assert config["tie_word_embeddings"] is True and config["rms_norm_eps"] == 1e-6
    # a chat model's turn ends with <end_of_turn>: generation stops there as well as at <eos>
    turn_end = gguf.GGUFReader(str(tiny.path)).fields["tokenizer.ggml.tokens"].contents().index(
        TURN_END)
    assert config["eos_token_id"] == [2, turn_end]
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, turn_end]


def test_a_gemma_without_chat_template_stops_at_its_eos_only(tmp_path):
    tiny = write_arch_gguf(tmp_path / "gemma3.gguf", "gemma3", layers=2, with_template=False)
    (tmp_path / "out").mkdir()
    assert write_model_files(tiny.path, tmp_path / "out")["eos_token_id"] == 2


def test_gemma2_alternates_sliding_and_full_layers_and_keeps_its_softcaps(tmp_path):
    tiny = write_arch_gguf(tmp_path / "gemma2.gguf", "gemma2", layers=4)
    (tmp_path / "out").mkdir()
    config = write_model_files(tiny.path, tmp_path / "out")
    assert config["model_type"] == "gemma2" and config["query_pre_attn_scalar"] == HEAD_DIM
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)
    assert config["sliding_window"] == WINDOW and config["rope_theta"] == 10000.0


def test_a_sliding_window_pattern_in_the_metadata_decides_the_layer_types():
    every_third = Metadata({"gemma3.attention.sliding_window_pattern": 3}, "gemma3", {})
    assert _layer_types(every_third, 4, 6) == ["sliding_attention", "sliding_attention",
                                               "full_attention", "sliding_attention"]
    listed = Metadata({"gemma3.attention.sliding_window_pattern": [True, False]}, "gemma3", {})
    assert _layer_types(listed, 2, 6) == ["sliding_attention", "full_attention"]
    with pytest.raises(GGUFError, match="lists 2 layers"):
        _layer_types(listed, 3, 6)


def test_the_27b_gemma_scales_queries_by_hidden_over_heads():
    """llama.cpp's rule (it stores no scale): Gemma 3 27B has 62 layers, 5376 / 32 = 168."""
    big = {"num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
           "head_dim": 128}
    assert _query_pre_attn_scalar(big, big_layer_count=62) == 168
    assert _query_pre_attn_scalar(big | {"num_hidden_layers": 34}, big_layer_count=62) == 128


def test_an_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "phi2.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / "out").mkdir()
    with pytest.raises(GGUFError, match="'phi2' is not supported.*gemma3.*llama.*qwen3"):
        write_model_files(path, tmp_path / "out")
