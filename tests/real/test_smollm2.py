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
