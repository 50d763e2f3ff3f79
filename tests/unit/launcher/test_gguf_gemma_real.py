"""The real Gemma 3 270M GGUF (Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors) converts into the
model transformers' own GGUF loader makes of it: the same weights, configuration and logits."""
import json

import pytest
import torch

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gemma_dir():
    """The float32 conversion (the one tests/real/test_gemma3.py serves), made once and cached."""
    from launcher.known_models import GEMMA3_270M
    from launcher.prepare import prepare_known_model

    return prepare_known_model(GEMMA3_270M, dtype="float32")


@pytest.fixture(scope="module")
def reference(gemma_dir):
    import transformers

    from launcher.known_models import GEMMA3_270M
    from launcher.model_cache import cache_root
    from launcher.prepare import fetch_gguf

    gguf_path = fetch_gguf(GEMMA3_270M, cache_root())
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()


def test_weights_equal_transformers_gguf_loading(gemma_dir, reference):
    from safetensors.torch import load_file

    expected = reference.state_dict()
    ours = load_file(str(gemma_dir / "model.safetensors"))
    assert set(ours) == set(expected) - {"lm_head.weight"}  # tied: the GGUF has no output.weight
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        # exact: both dequantise the same blocks; norms are back from llama.cpp's 1 + weight
        assert torch.equal(tensor, expected[name]), name


def test_config_and_logits_equal_transformers_gguf_loading(gemma_dir, reference):
    import transformers

    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    ours = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "layer_types", "sliding_window",
                "rope_parameters", "query_pre_attn_scalar", "hidden_activation",
                "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings",
                "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id"):
        assert getattr(ours.config, key) == getattr(reference.config, key), key
    # the 6th, 12th and 18th layers see everything, the others 512 tokens
    full = [i for i, kind in enumerate(ours.config.layer_types) if kind == "full_attention"]
    assert full == [5, 11, 17]
    # "<bos>The capital of France is", and more than a window's worth of text after it
    prompt = torch.tensor([[2, 818, 5279, 529, 7001, 563] + list(range(1000, 1600))])
    with torch.no_grad():
        assert torch.equal(ours(prompt).logits, reference(prompt).logits)
