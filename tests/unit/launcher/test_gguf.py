"""GGUF -> Hugging Face conversion: names, the rope row permutation, dequantisation, config."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from launcher.gguf import convert_weights, hf_tensor_name, llama_config, unpermute_rope_rows

gguf = pytest.importorskip("gguf")

HEADS, KV_HEADS, HIDDEN, FFN, VOCAB = 4, 2, 64, 96, 128
HEAD_DIM = HIDDEN // HEADS


def permute_like_llama_cpp(w, heads):
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((HEADS * HEAD_DIM, HIDDEN)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(permute_like_llama_cpp(w, HEADS), HEADS), w)


def test_names_map_to_hugging_face():
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"


def _write_tiny_gguf(path):
    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    originals = {
        "model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((HIDDEN, HIDDEN)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(HIDDEN),
    }
    originals = {k: v.astype(np.float32) for k, v in originals.items()}
    writer.add_tensor("token_embd.weight",
                      gguf.quants.quantize(originals["model.embed_tokens.weight"],
                                           gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight",
                      permute_like_llama_cpp(originals["model.layers.0.self_attn.q_proj.weight"], HEADS))
    writer.add_tensor("blk.0.attn_k.weight",
                      permute_like_llama_cpp(originals["model.layers.0.self_attn.k_proj.weight"],
                                             KV_HEADS))
    writer.add_tensor("blk.0.attn_norm.weight", originals["model.layers.0.input_layernorm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


def test_weights_round_trip_through_gguf(tmp_path):
    originals = _write_tiny_gguf(tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    config = llama_config(reader)
    assert config["num_key_value_heads"] == KV_HEADS and config["rope_theta"] == 50000.0
    assert config["tie_word_embeddings"] is True
    json.dumps(config)  # must be writable as config.json
    convert_weights(reader, config, tmp_path / "model.safetensors")
    converted = load_file(str(tmp_path / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(converted[name], torch.from_numpy(originals[name])), name
    embed = converted["model.embed_tokens.weight"]
    assert embed.shape == (VOCAB, HIDDEN)
    assert (embed - torch.from_numpy(originals["model.embed_tokens.weight"])).abs().max() < 0.05
