"""Our Llama family against `transformers` on tiny random weights: prefill then 16 paged decode steps."""
import pytest
import torch

from shard.distributed import ParallelContext
from shard.kv_budget import KVCacheSpec
from shard.loader import load_model
from shard.model_runner import ModelRunner, PrefillSequence
from tests.tiny_models import build_tiny_model

BLOCK_SIZE = 4
DECODE_STEPS = 16


def _runner(model_dir, dtype=torch.float32):
    loaded = load_model(model_dir, dtype=dtype, device=torch.device("cpu"),
                        parallel=ParallelContext())
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK_SIZE,
                       dtype, torch.device("cpu"))
    runner = ModelRunner(loaded.model, spec)
    runner.allocate(64)
    return runner


def _reference(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "pytorch-attention"])
@pytest.mark.parametrize("variant", [
    dict(architecture="llama", num_heads=4, num_kv_heads=4),
    dict(architecture="llama", num_heads=4, num_kv_heads=2),
    dict(architecture="llama", num_heads=4, num_kv_heads=1, attention_bias=True,
         tie_word_embeddings=True),
    dict(architecture="qwen2", num_heads=4, num_kv_heads=2),
], ids=["mha", "gqa", "mqa-bias-tied", "qwen2-bias"])
def test_logits_match_transformers_through_paged_cache(tmp_path, variant, kernel):
    model_dir = build_tiny_model(tmp_path / "model", **variant)
    runner, reference = _runner(model_dir), _reference(model_dir)
    if kernel and not runner.paged_kernel:
        pytest.skip("no C compiler here: decode attention stays in PyTorch")
    runner.paged_kernel = kernel
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
        logits = runner.decode(next_ids, seq_lens, block_tables).logits
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


def test_bf16_on_a_cpu_without_bf16_arithmetic_is_float32_math_on_the_bf16_values(tmp_path,
                                                                                 monkeypatch):
    """The AVX2 path (forced here on any CPU): weights and KV cache stay bf16, activations and
    arithmetic are float32, so the result is transformers in float32 on the bf16-rounded weights,
    up to the bf16 rounding of the cached keys and values."""
    from shard.layers import linear, precision

    for module in (precision, linear):  # an AVX2 CPU where our C matmul does not build
        monkeypatch.setattr(module, "cpu_has_bf16_kernels", lambda: False)
        monkeypatch.setattr(module, "c_matmul_runs", lambda: False)
    model_dir = build_tiny_model(tmp_path / "model", num_heads=4, num_kv_heads=2)
    runner = _runner(model_dir, torch.bfloat16)
    assert runner.model.activation_dtype == torch.float32
    assert runner.cache[0].key.dtype == torch.bfloat16
    reference = _reference(model_dir).to(torch.bfloat16).to(torch.float32)
    prompt = [5, 17, 42, 99, 3, 250, 7, 11, 12]
    logits = runner.prefill([PrefillSequence(prompt, 0, [3, 1, 7])], all_logits_rows={0})
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    # a fresh prompt attends over its own float32 keys: only summation order differs
    assert (logits.full[0] - expected).abs().max().item() <= 1e-4
    tokens = list(prompt)
    next_id = logits.last.argmax(-1)
    for step in range(4):
        tokens.append(int(next_id))
        out = runner.decode(next_id, torch.tensor([len(tokens) - 1]),
                             torch.tensor([[3, 1, 7, 0]])).logits
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1]
        # decode reads the bf16 cache, and a one-row product rounds its input to bf16: 3e-3 here
        assert (out[0] - expected).abs().max().item() <= 1e-2 * expected.abs().max().item()
        next_id = out.argmax(-1)


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "pytorch-attention"])
def test_bf16_on_a_cpu_with_bf16_arithmetic_keeps_bf16_activations(tmp_path, monkeypatch, kernel):
    """The decision of a CPU with bf16 kernels (forced here on any CPU; the linear layers keep this
    CPU's own form, as the oneDNN prepack needs the instructions): bf16 activations over a bf16
    cache through a fresh prompt, a prompt continued from the cache and decode steps, with logits
    within bf16 rounding of transformers in float32 on the same bf16 weights."""
    from shard.layers import precision

    monkeypatch.setattr(precision, "cpu_has_bf16_kernels", lambda: True)
    model_dir = build_tiny_model(tmp_path / "model", num_heads=4, num_kv_heads=2)
    runner = _runner(model_dir, torch.bfloat16)
    if kernel and not runner.paged_kernel:
        pytest.skip("no C compiler here: decode attention stays in PyTorch")
    runner.paged_kernel = kernel
    assert runner.model.activation_dtype == runner.cache[0].key.dtype == torch.bfloat16
    reference = _reference(model_dir).to(torch.bfloat16).to(torch.float32)
    prompt = [5, 17, 42, 99, 3, 250, 7, 11, 12]
    tokens = list(prompt)
    logits = runner.prefill([PrefillSequence(prompt[:5], 0, [3, 1, 7])])
    # the rest of the prompt reads its prefix from the cache; then decode steps
    logits = runner.prefill([PrefillSequence(prompt[5:], 5, [3, 1, 7])], all_logits_rows={0})
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, 5:]
    assert (logits.full[0] - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
    next_id = logits.last.argmax(-1)
    for _ in range(3):
        tokens.append(int(next_id))
        out = runner.decode(next_id, torch.tensor([len(tokens) - 1]),
                             torch.tensor([[3, 1, 7, 0]])).logits
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1]
        assert (out[0] - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()
        next_id = out.argmax(-1)
