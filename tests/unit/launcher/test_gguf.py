"""GGUF -> Hugging Face conversion: names, the rope row permutation, dequantisation, config, tokenizer."""
import json
import stat

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from launcher import gguf as conversion
from launcher.gguf import (GGUFError, convert_gguf, hf_tensor_name, is_converted,
                           unpermute_rope_rows, write_model_files)
from tests.unit.launcher.tiny_gguf import (CHAT_TEMPLATE, CONTEXT, HEAD_DIM, HEADS, HIDDEN,
                                           KV_HEADS, LAYERS, permute_like_llama_cpp,
                                           write_tiny_gguf)

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _convert_without_tokenizer(gguf_path, out_dir):
    out_dir.mkdir()
    return write_model_files(gguf.GGUFReader(str(gguf_path)), out_dir)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(permute_like_llama_cpp(w, HEADS), HEADS), w)
    assert not np.array_equal(permute_like_llama_cpp(w, HEADS), w)


def test_names_map_to_hugging_face():
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(GGUFError, match="unknown GGUF tensor"):
        hf_tensor_name("blk.0.attn_qkv.weight")
    with pytest.raises(GGUFError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


def test_every_tensor_round_trips_with_hugging_face_names_and_layout(tiny, tmp_path):
    _convert_without_tokenizer(tiny.path, tmp_path / "out")
    converted = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(converted) == set(tiny.expected)
    assert {t for t in tiny.types.values()} == {"F32", "F16", "Q8_0", "Q4_1"}
    for name, expected in tiny.expected.items():
        tensor = converted[name]
        assert tensor.dtype == torch.float32 and tuple(tensor.shape) == expected.shape, name
        # exact: F32 and F16 losslessly, quantised ones equal to dequantising the same blocks
        assert torch.equal(tensor, torch.from_numpy(expected)), (name, tiny.types[name])
    q = converted["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (HEADS * HEAD_DIM, HIDDEN)
    assert converted["model.layers.0.self_attn.k_proj.weight"].shape == (KV_HEADS * HEAD_DIM, HIDDEN)
    assert converted["model.layers.0.mlp.down_proj.weight"].shape[0] == HIDDEN


def test_config_and_generation_config(tiny, tmp_path):
    _convert_without_tokenizer(tiny.path, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 96, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,  # stored as float32; written with its short spelling
        "rope_theta": 50000.0, "max_position_embeddings": CONTEXT, "vocab_size": tiny.vocab,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "torch_dtype": "float32",
    }
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}


def test_without_output_tensor_embeddings_are_tied(tmp_path):
    tied = write_tiny_gguf(tmp_path / "tied.gguf", with_output=False, rope_scale=4.0)
    config = _convert_without_tokenizer(tied.path, tmp_path / "out")
    assert config["tie_word_embeddings"] is True
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert "lm_head.weight" not in load_file(str(tmp_path / "out" / "model.safetensors"))


def test_full_conversion_matches_transformers_gguf_loading(tiny, tmp_path):
    import transformers

    out = convert_gguf(tiny.path, tmp_path / "model")
    assert sorted(p.name for p in out.iterdir()) == [
        ".complete", "chat_template.jinja", "config.json", "generation_config.json",
        "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert is_converted(out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny.path.parent), gguf_file=tiny.path.name, dtype=torch.float32).state_dict()
    for name, tensor in load_file(str(out / "model.safetensors")).items():
        assert (tensor - reference[name]).abs().max().item() < 1e-6, name
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert ours.config.num_key_value_heads == KV_HEADS


def test_tokenizer_and_chat_template_come_from_the_gguf(tiny, tmp_path):
    import transformers
    from tokenizers import Tokenizer

    out = convert_gguf(tiny.path, tmp_path / "model")
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert tokenizer_config["bos_token"] == "<s>" and tokenizer_config["eos_token"] == "</s>"
    assert tokenizer_config["model_max_length"] == CONTEXT

    reference = transformers.AutoTokenizer.from_pretrained(str(tiny.path.parent),
                                                           gguf_file=tiny.path.name)
    original = Tokenizer.from_file(str(tiny.path.parent / "tiny-tokenizer" / "tokenizer.json"))
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ("Hello world", "The quick brown fox", "café 日本 🙂", "<s>user: hi</s>"):
        assert ours.encode(text).ids == reference(text).input_ids == original.encode(text).ids
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    prompt = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                        add_generation_prompt=True)
    assert prompt == "<s>user: hi</s>\n<s>assistant: "


def test_interrupted_conversion_leaves_no_directory(tiny, tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(conversion, "write_tokenizer", fail)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny.path, tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_conversion_replaces_an_older_directory(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(conversion, "write_tokenizer",
                        lambda gguf_path, out_dir, **kw: (out_dir / "tokenizer.json").write_text("{}"))
    old = tmp_path / "model"
    old.mkdir()
    (old / "stale.bin").write_text("old")
    (old / ".complete").write_text("/from/an/old/converter\n")
    assert not is_converted(old)
    convert_gguf(tiny.path, old)
    assert not (old / "stale.bin").exists() and is_converted(old)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
