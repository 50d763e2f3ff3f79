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


BEAM_PROMPTS = PROMPTS[2:4] + [
    "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n"
    "<|im_start|>assistant\n"]
BEAM_TOKENS = 24


@pytest.mark.parametrize("num_beams,length_penalty", [(2, 1.0), (4, 1.0), (4, 0.0), (2, 2.0)])
def test_beam_search_equals_transformers(real_model_dir, num_beams, length_penalty):
    import transformers

    engine = make_engine(real_model_dir, block_size=16, num_blocks=128)
    tokenizer = engine.tokenizer
    pool = BlockPool(128)
    prompt_ids = [tokenizer.encode(p).ids for p in BEAM_PROMPTS]
    requests = []
    for i, ids in enumerate(prompt_ids):
        per_beam = -(-(len(ids) + BEAM_TOKENS - 1) // 16)
        r = request(i, ids, pool.take((num_beams * per_beam + 1) * 16, 16),
                    max_new_tokens=BEAM_TOKENS)
        r.num_beams, r.length_penalty = num_beams, length_penalty
        requests.append(r)
    out = engine.prefill(1, requests)
    assert out.rejected == []
    finals = {}
    while True:
        finals.update({g.request_id: g.generated_text for g in out.generations
                       if g.generated_text is not None})
        if out.batch is None or all(r in finals for r in out.batch.request_ids):
            break
        alive = [r for r in out.batch.request_ids if r not in finals]
        if len(alive) < len(out.batch.request_ids):
            engine.filter(out.batch.id, alive)
        out = engine.decode([out.batch.id])
    engine.clear()

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        real_model_dir, dtype=torch.float32).eval()
    for i, ids in enumerate(prompt_ids):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=BEAM_TOKENS,
                                          num_beams=num_beams, length_penalty=length_penalty,
                                          do_sample=False)[0, len(ids):].tolist()
        assert finals[i].token_ids == expected, (BEAM_PROMPTS[i], finals[i].text,
                                                 tokenizer.decode(expected))
        assert finals[i].text == tokenizer.decode(expected, skip_special_tokens=True)
    if length_penalty <= 1.0:  # (2.0 favours the longest) one answer ended on EOS early
        assert any(len(f.token_ids) < BEAM_TOKENS for f in finals.values())
