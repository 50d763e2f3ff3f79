"""GGUF -> Hugging Face conversion: names, the rope row permutation, dequantisation, config, tokenizer,
bf16 or float32 shards, and the architectures besides Llama."""
import json
import stat

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from launcher import gguf as conversion
from launcher import safetensors_stream
from launcher.gguf import (GGUFError, convert_gguf, hf_tensor_name, is_converted,
                           unpermute_rope_rows, write_model_files)
from launcher.gguf_architectures import ARCHITECTURES
from shard.checkpoint_files import checkpoint_files
from tests.unit.launcher.tiny_gguf import (CHAT_TEMPLATE, CONTEXT, HEAD_DIM, HEADS, HIDDEN,
                                           KV_HEADS, LAYERS, permute_like_llama_cpp,
                                           write_tiny_gguf)

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


LLAMA = ARCHITECTURES["llama"]


def _convert_without_tokenizer(gguf_path, out_dir, dtype="float32", progress=None):
    out_dir.mkdir()
    return write_model_files(gguf_path, out_dir, progress, dtype=dtype)


def _bf16(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values).to(torch.bfloat16)  # round to nearest even


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(permute_like_llama_cpp(w, HEADS), HEADS), w)
    assert not np.array_equal(permute_like_llama_cpp(w, HEADS), w)


def test_names_map_to_hugging_face():
    assert hf_tensor_name("blk.3.attn_q.weight", LLAMA) == "model.layers.3.self_attn.q_proj.weight"
    assert (hf_tensor_name("blk.0.ffn_norm.weight", LLAMA)
            == "model.layers.0.post_attention_layernorm.weight")
    assert hf_tensor_name("token_embd.weight", LLAMA) == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight", LLAMA) == "lm_head.weight"
    with pytest.raises(GGUFError, match="unknown GGUF tensor"):
        hf_tensor_name("blk.0.attn_qkv.weight", LLAMA)
    with pytest.raises(GGUFError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight", LLAMA)
    # Gemma normalises before and after both blocks: its ffn_norm is the one before the MLP
    gemma3 = ARCHITECTURES["gemma3"]
    assert (hf_tensor_name("blk.2.ffn_norm.weight", gemma3)
            == "model.layers.2.pre_feedforward_layernorm.weight")
    assert (hf_tensor_name("blk.2.post_attention_norm.weight", gemma3)
            == "model.layers.2.post_attention_layernorm.weight")
    assert (hf_tensor_name("blk.2.attn_k_norm.weight", gemma3)
            == "model.layers.2.self_attn.k_norm.weight")
    with pytest.raises(GGUFError, match="unknown GGUF tensor"):
        hf_tensor_name("blk.0.attn_q_norm.weight", LLAMA)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_tensor_round_trips_with_hugging_face_names_and_layout(tiny, tmp_path, dtype,
                                                                     monkeypatch):
    # slices of 16 rows: every matrix is read in several, q and k a head at a time
    monkeypatch.setattr(conversion, "CHUNK_ELEMENTS", 16 * 64)
    _convert_without_tokenizer(tiny.path, tmp_path / "out", dtype)
    converted = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(converted) == set(tiny.expected)
    assert {t for t in tiny.types.values()} == {"F32", "F16", "Q8_0", "Q4_1"}
    for name, expected in tiny.expected.items():
        tensor = converted[name]
        assert str(tensor.dtype) == f"torch.{dtype}" and tuple(tensor.shape) == expected.shape
        # float32 exact: F32 and F16 losslessly, quantised ones equal to dequantising the same
        # blocks; bfloat16 those values rounded to nearest even
        want = torch.from_numpy(expected) if dtype == "float32" else _bf16(expected)
        assert torch.equal(tensor, want), (name, tiny.types[name])
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


def test_progress_counts_the_gguf_tensor_bytes_up_to_their_total(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(conversion, "CHUNK_ELEMENTS", 16 * 64)
    seen = []
    _convert_without_tokenizer(tiny.path, tmp_path / "out", progress=lambda *a: seen.append(a))
    total = sum(t.n_bytes for t in gguf.GGUFReader(str(tiny.path)).tensors)
    assert len(seen) > len(tiny.expected)  # several slices per matrix
    assert {t for _, t in seen} == {total} and seen[-1][0] == total
    assert all(a[0] < b[0] for a, b in zip(seen, seen[1:]))


def test_a_model_larger_than_a_shard_is_written_in_shards_with_an_index(tiny, tmp_path,
                                                                        monkeypatch):
    import transformers

    monkeypatch.setattr(safetensors_stream, "MAX_SHARD_BYTES", 40_000)
    out = tmp_path / "out"
    _convert_without_tokenizer(tiny.path, out, "bfloat16")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tiny.expected)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(2 * v.size for v in tiny.expected.values())
    for name in files:
        shard = load_file(str(out / name))
        # a shard exceeds the limit only when it holds one tensor bigger than it
        assert (sum(t.nbytes for t in shard.values()) <= 40_000 or len(shard) == 1)
        for tensor_name, tensor in shard.items():
            assert index["weight_map"][tensor_name] == name
            assert torch.equal(tensor, _bf16(tiny.expected[tensor_name]))
    assert [p.name for p in checkpoint_files(out)] == files
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert torch.equal(loaded.state_dict()["model.norm.weight"],
                       _bf16(tiny.expected["model.norm.weight"]).float())


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
    assert is_converted(out) and is_converted(out, dtype="bfloat16")
    assert not is_converted(out, dtype="float32")  # another dtype is another conversion
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny.path.parent), gguf_file=tiny.path.name, dtype=torch.float32).state_dict()
    for name, tensor in load_file(str(out / "model.safetensors")).items():
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    ours = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert ours.config.num_key_value_heads == KV_HEADS and ours.dtype == torch.bfloat16

    f32 = convert_gguf(tiny.path, tmp_path / "model-f32", dtype="float32")
    assert is_converted(f32, dtype="float32") and not is_converted(f32)
    for name, tensor in load_file(str(f32 / "model.safetensors")).items():
        assert torch.equal(tensor, reference[name]), name


def test_only_bfloat16_and_float32_are_written(tiny, tmp_path):
    with pytest.raises(ValueError, match="bfloat16, float32, gguf"):
        convert_gguf(tiny.path, tmp_path / "model", dtype="float16")
    with pytest.raises(ValueError, match="bfloat16, float32, gguf"):
        is_converted(tmp_path, dtype="int4")
    assert list(tmp_path.iterdir()) == []


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


def test_quantization_is_named_from_the_header(tiny, tmp_path):
    assert conversion.quantization_name(tiny.path) == ""  # the file does not say
    path = tmp_path / "q4km.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert conversion.quantization_name(path) == "Q4_K_M"


def test_a_truncated_or_foreign_file_is_refused_before_converting(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.path.read_bytes()[:-100])
    with pytest.raises(GGUFError, match="truncated: tensor output.weight"):
        conversion.read_gguf(cut)
    cut.write_bytes(tiny.path.read_bytes()[:200])
    with pytest.raises(GGUFError, match="ends inside its header"):
        conversion.read_gguf(cut)
    cut.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match="not a GGUF file"):
        conversion.read_gguf(cut)
    cut.write_bytes(b"")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        conversion.read_gguf(cut)


def test_a_one_element_array_and_a_bad_file_read_as_such(tmp_path):
    """A numeric array of one element is a list of one (a one-layer model's per-layer arrays);
    a file that is no GGUF is a GGUFError, which the launcher reports in one line."""
    import gguf

    from launcher.gguf_architectures import GGUFError
    from launcher.gguf_file import read_gguf

    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("llama.attention.head_count", [4])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = read_gguf(path).metadata
    assert metadata["llama.attention.head_count"] == [4]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all, just some bytes")
    with pytest.raises(GGUFError):
        read_gguf(bad)


def test_the_launcher_refuses_a_file_that_is_no_gguf_in_one_line(tmp_path, monkeypatch, capfd):
    import faulthandler
    import signal

    from launcher.__main__ import main

    monkeypatch.setenv("TGI_PY_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all, just some bytes")
    try:
        assert main(["--model-id", str(bad), "--device", "cpu"]) == 1
    finally:
        faulthandler.unregister(signal.SIGUSR1)  # main's, writing to this test's stderr
    said = capfd.readouterr().err
    assert "not a GGUF file" in said and "Traceback" not in said
