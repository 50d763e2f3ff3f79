"""Our Llama family against `transformers` on tiny random weights: prefill then 16 paged decode steps."""
import pytest
import torch

from shard.distributed import ParallelContext
from shard.loader import load_model
from shard.model_runner import KVCacheSpec, ModelRunner, PrefillSequence
from tests.tiny_models import build_tiny_model

BLOCK_SIZE = 4
DECODE_STEPS = 16


def _runner(model_dir):
    loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                        parallel=ParallelContext())
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK_SIZE,
                       torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, spec)
    runner.allocate(64)
    return runner


def _reference(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", [
    dict(architecture="llama", num_heads=4, num_kv_heads=4),
    dict(architecture="llama", num_heads=4, num_kv_heads=2),
    dict(architecture="llama", num_heads=4, num_kv_heads=1, attention_bias=True,
         tie_word_embeddings=True),
    dict(architecture="qwen2", num_heads=4, num_kv_heads=2),
], ids=["mha", "gqa", "mqa-bias-tied", "qwen2-bias"])
def test_logits_match_transformers_through_paged_cache(tmp_path, variant):
    model_dir = build_tiny_model(tmp_path / "model", **variant)
    runner, reference = _runner(model_dir), _reference(model_dir)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [11, 12], [200, 201, 202, 203, 204, 205, 206, 207, 208]]
    # blocks deliberately out of order and interleaved between sequences
    blocks = [[9, 3, 14, 1, 20, 30, 31], [2, 8, 13, 21, 22, 23], [4, 5, 6, 7, 10, 11, 12, 15]]
    seqs = [PrefillSequence(p, 0, b) for p, b in zip(prompts, blocks)]
    logits = runner.prefill(seqs, all_logits_rows={0, 1, 2})
    last, full = logits.last, logits.full
    tokens = [list(p) for p in prompts]
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            expected = reference(torch.tensor([prompt])).logits[0]
            assert (full[i] - expected).abs().max().item() <= 1e-4
    next_ids = last.argmax(-1)
    seq_lens = torch.tensor([len(p) for p in prompts])
    block_tables = torch.tensor([b + [0] * (8 - len(b)) for b in blocks])
    for _ in range(DECODE_STEPS):
        for row, token in enumerate(next_ids.tolist()):
            tokens[row].append(token)
        logits = runner.decode(next_ids, seq_lens, block_tables)
        with torch.no_grad():
            for row, seq in enumerate(tokens):
                expected = reference(torch.tensor([seq])).logits[0, -1]
                assert (logits[row] - expected).abs().max().item() <= 1e-4
        seq_lens = seq_lens + 1
        next_ids = logits.argmax(-1)


def test_prompt_continued_from_cache_matches_transformers(tmp_path):
    """A prompt computed in two parts (later part reads the cached prefix) equals one full forward."""
    model_dir = build_tiny_model(tmp_path / "model", num_heads=4, num_kv_heads=2)
    runner, reference = _runner(model_dir), _reference(model_dir)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    blocks = [5, 2, 9]
    runner.prefill([PrefillSequence(prompt[:6], 0, blocks)])
    full = runner.prefill([PrefillSequence(prompt[6:], 6, blocks),
                           PrefillSequence(prompt, 0, [1, 3, 4])], all_logits_rows={0, 1}).full
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert (full[0] - expected[6:]).abs().max().item() <= 1e-4
    assert (full[1] - expected).abs().max().item() <= 1e-4
