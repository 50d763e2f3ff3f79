"""The real SmolLM2-135M-Instruct: greedy generations equal transformers' `generate` on the same weights."""
import pytest
import torch

from tests.engine_helpers import BlockPool, make_engine, request, run_to_completion

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time",
    "The three primary colors are",
]
NEW_TOKENS = 32


def test_greedy_generations_equal_transformers(real_model_dir):
    import transformers

    engine = make_engine(real_model_dir, block_size=16, num_blocks=64)
    tokenizer = engine.tokenizer
    pool = BlockPool(64)
    prompt_ids = [tokenizer.encode(p).ids for p in PROMPTS]
    requests = [request(i, ids, pool.take(len(ids) + NEW_TOKENS, 16), max_new_tokens=NEW_TOKENS)
                for i, ids in enumerate(prompt_ids)]
    ours = run_to_completion(engine, requests)

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        real_model_dir, dtype=torch.float32).eval()
    for i, ids in enumerate(prompt_ids):
        with torch.no_grad():
            generated = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                           do_sample=False)[0, len(ids):].tolist()
        assert ours[i] == generated, (PROMPTS[i], tokenizer.decode(ours[i]),
                                      tokenizer.decode(generated))
    assert any(len(t) < NEW_TOKENS for t in ours.values()), "one prompt should stop on EOS"
    assert any(len(t) == NEW_TOKENS for t in ours.values())


def test_prepared_directory_is_complete_and_reused(real_model_dir):
    from launcher.prepare import prepare_default_model

    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "generation_config.json"):
        assert (real_model_dir / name).exists(), name
    assert "<|im_start|>" in (real_model_dir / "chat_template.jinja").read_text()
    before = (real_model_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare_default_model(real_model_dir.parent.parent) == real_model_dir
    assert (real_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_converted_weights_equal_transformers_gguf_loading(real_model_dir):
    """Our dequantisation and rope un-permutation against transformers' own GGUF loader."""
    import transformers
    from safetensors.torch import load_file

    from launcher.prepare import fetch_default_gguf

    gguf_path = fetch_default_gguf(real_model_dir.parent.parent)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).state_dict()
    ours = load_file(str(real_model_dir / "model.safetensors"))
    for name, tensor in ours.items():
        assert (tensor - reference[name]).abs().max().item() < 1e-5, name
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                          gguf_file=gguf_path.name)
    from tokenizers import Tokenizer

    ours_tok = Tokenizer.from_file(str(real_model_dir / "tokenizer.json"))
    for text in ("Hello world", "café 日本 🙂", "<|im_start|>user\nhi<|im_end|>"):
        assert ours_tok.encode(text).ids == tokenizer(text).input_ids
