"""Gemma 2 and Gemma 3 (text) against `transformers` on tiny random weights: logits through the
paged cache (prefill, then decode steps past the sliding window), greedy decoding through the engine
(with a prefix-cache hit and a chunked prefill), two tensor-parallel ranks, a multimodal Gemma 3
checkpoint served text-only, and config.json parsing.

The tiny models keep what sets Gemma apart measurable: norm weights away from zero (Gemma scales by
1 + weight), soft caps (Gemma 2) low enough to bend the scores and logits, a sliding window shorter
than the prompts, query_pre_attn_scalar other than head_dim, and for Gemma 3 two rope tables (a
linear-scaled global one) and a layer pattern of its own.
"""
from pathlib import Path

import pytest
import torch

from shard.distributed import ParallelContext
from shard.kv_budget import KVCacheSpec
from shard.loader import load_model
from shard.model_runner import ModelRunner, PrefillSequence
from shard.models.gemma import FULL, SLIDING, GemmaConfig
from tests.engine_helpers import BlockPool, make_engine, request, run_to_completion
from tests.parity.test_tensor_parallel import _logits as tensor_parallel_logits
from tests.tiny_models import TINY_VOCAB, build_tokenizer

BLOCK_SIZE = 4
DECODE_STEPS = 16
WINDOW = {2: 4, 3: 5}  # shorter than every prompt below but one


def build_tiny_gemma(out_dir: Path, generation: int, *, num_heads: int = 4, num_kv_heads: int = 2,
                     seed: int = 0) -> Path:
    """Saves a random Gemma 2 or Gemma 3 (text) model with a 320-token vocabulary to `out_dir`."""
    import transformers

    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, query_pre_attn_scalar=24, initializer_range=0.1,
                  sliding_window=WINDOW[generation], bos_token_id=1, eos_token_id=2,
                  pad_token_id=2)
    if generation == 2:  # layers: sliding, global, sliding (Gemma 2's default alternation)
        # caps near the scores and logits these weights give: each bends them by ~0.25
        config = transformers.Gemma2Config(attn_logit_softcapping=1.0,
                                           final_logit_softcapping=1.0, **common)
        model = transformers.Gemma2ForCausalLM(config)
    else:
        rope = {FULL: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
                SLIDING: {"rope_type": "default", "rope_theta": 10_000.0}}
        config = transformers.Gemma3TextConfig(layer_types=[SLIDING, SLIDING, FULL],
                                               rope_parameters=rope, **common)
        model = transformers.Gemma3ForCausalLM(config)
    with torch.no_grad():  # norms start at zero weight (a scale of 1): make them count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0, 0.5)
        # scaled by sqrt(hidden) and tied to the head, full-size random embeddings outweigh the
        # layers, and greedy decoding repeats the last token: smaller, the layers choose
        model.model.embed_tokens.weight.mul_(0.3)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return out_dir


class _TinyGemmas(dict):
    """Each generation's model directory, built on first use."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, generation: int) -> Path:
        out_dir = self.tmp_path_factory.mktemp(f"gemma{generation}")
        self[generation] = build_tiny_gemma(out_dir, generation)
        return self[generation]


@pytest.fixture(scope="module")
def tiny_gemmas(tmp_path_factory) -> _TinyGemmas:
    return _TinyGemmas(tmp_path_factory)


@pytest.fixture(params=[2, 3], ids=["gemma2", "gemma3"])
def gemma(request, tiny_gemmas) -> tuple[int, Path]:
    return request.param, tiny_gemmas[request.param]


def _runner(model_dir: Path, dtype: torch.dtype = torch.float32) -> ModelRunner:
    loaded = load_model(model_dir, dtype=dtype, device=torch.device("cpu"),
                        parallel=ParallelContext())
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK_SIZE,
                       dtype, torch.device("cpu"))
    runner = ModelRunner(loaded.model, spec)
    runner.allocate(64)
    return runner


def _reference(model_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "pytorch-attention"])
def test_logits_match_transformers_through_paged_cache(gemma, kernel):
    generation, model_dir = gemma
    runner, reference = _runner(model_dir), _reference(model_dir)
    if kernel and not runner.paged_kernel:
        pytest.skip("no C compiler here: decode attention stays in PyTorch")
    runner.paged_kernel = kernel
    assert runner.c_step is None, "the C decode step is Llama's alone"
    window = runner.model.config.sliding_window
    assert window == WINDOW[generation]
    prompts = [[5, 17, 42, 99, 3, 250, 7], [11, 12],
               [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210]]
    assert max(map(len, prompts)) > window + 4
    # blocks deliberately out of order and interleaved between sequences
    blocks = [[9, 3, 14, 1, 20, 30], [2, 8, 13, 21, 22], [4, 5, 6, 7, 10, 11, 12]]
    seqs = [PrefillSequence(p, 0, b) for p, b in zip(prompts, blocks)]
    logits = runner.prefill(seqs, all_logits_rows={0, 1, 2})
    tokens = [list(p) for p in prompts]
    ours = [[row] for row in logits.full]  # each row's logits at every position so far
    next_ids = logits.last.argmax(-1)
    seq_lens = torch.tensor([len(p) for p in prompts])
    block_tables = torch.tensor([b + [0] * (7 - len(b)) for b in blocks])
    for _ in range(DECODE_STEPS):
        for row, token in enumerate(next_ids.tolist()):
            tokens[row].append(token)
        step = runner.decode(next_ids, seq_lens, block_tables).logits
        for row in range(len(prompts)):
            ours[row].append(step[row:row + 1])
        seq_lens = seq_lens + 1
        next_ids = step.argmax(-1)
    # a causal model's logits at a position depend on the tokens up to it alone: one forward over
    # each finished sequence gives what the prefill and every decode step should have given
    with torch.no_grad():
        for row, seq in enumerate(tokens):
            expected = reference(torch.tensor([seq])).logits[0]
            assert (torch.cat(ours[row]) - expected).abs().max().item() <= 1e-4


def test_prompt_continued_from_cache_matches_transformers(gemma):
    """A prompt computed in three parts (each later part reads the cached prefix, and its first
    queries' windows reach back into it) equals one full forward."""
    _, model_dir = gemma
    runner, reference = _runner(model_dir), _reference(model_dir)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    blocks = [5, 2, 9, 1]
    runner.prefill([PrefillSequence(prompt[:3], 0, blocks)])
    runner.prefill([PrefillSequence(prompt[3:8], 3, blocks)])
    full = runner.prefill([PrefillSequence(prompt[8:], 8, blocks),
                           PrefillSequence(prompt, 0, [3, 4, 6, 7])], all_logits_rows={0, 1}).full
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert (full[0] - expected[8:]).abs().max().item() <= 1e-4
    assert (full[1] - expected).abs().max().item() <= 1e-4


def test_bf16_activations_stay_within_bf16_rounding_of_transformers(gemma, monkeypatch):
    """bf16 activations over a bf16 cache (as on a CPU with bf16 arithmetic, forced here: Gemma's
    norms then scale in float32 and round once, in Python), through a prompt continued from the
    cache and decode steps past the window: logits within bf16 rounding of transformers in float32
    on the same bf16 weights."""
    from shard.layers import precision

    monkeypatch.setattr(precision, "cpu_has_bf16_kernels", lambda: True)
    _, model_dir = gemma
    runner = _runner(model_dir, torch.bfloat16)
    assert runner.model.activation_dtype == runner.cache[0].key.dtype == torch.bfloat16
    reference = _reference(model_dir).to(torch.bfloat16).to(torch.float32)
    prompt = [5, 17, 42, 99, 3, 250, 7, 11, 12]
    blocks = [3, 1, 7, 9]
    runner.prefill([PrefillSequence(prompt[:5], 0, blocks)])
    logits = runner.prefill([PrefillSequence(prompt[5:], 5, blocks)], all_logits_rows={0})
    ours, tokens = [logits.full[0]], list(prompt)
    next_id = logits.last.argmax(-1)
    for _ in range(6):
        tokens.append(int(next_id))
        step = runner.decode(next_id, torch.tensor([len(tokens) - 1]), torch.tensor([blocks]))
        ours.append(step.logits)
        next_id = step.logits.argmax(-1)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0, 5:]
    assert (torch.cat(ours) - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()


def _greedy_reference(reference, prompt: list[int], max_new: int) -> list[int]:
    reference.generation_config.eos_token_id = None  # as ignore_eos: every request runs max_new
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_greedy_decoding_through_the_engine_matches_transformers_generate(gemma):
    """Three requests batched, then a prefix-cache hit (a request reading the first one's blocks)
    and a prompt prefilled in chunks of 3 (windows spanning chunks): the tokens transformers'
    greedy `generate` gives each prompt alone."""
    _, model_dir = gemma
    engine, reference, pool = make_engine(model_dir), _reference(model_dir), BlockPool(512)
    texts = ["The quick brown fox jumps over the lazy dog", "Paris is",
             "Once upon a time there was a small model"]
    prompts = [engine.tokenizer.encode(t).ids for t in texts]
    max_new = 10
    expected = [_greedy_reference(reference, p, max_new) for p in prompts]
    blocks = [pool.take(len(p) + max_new, BLOCK_SIZE) for p in prompts]
    requests = [request(i, p, b, max_new_tokens=max_new, ignore_eos=True)
                for i, (p, b) in enumerate(zip(prompts, blocks))]
    got = run_to_completion(engine, requests)
    assert [got[i] for i in range(3)] == expected

    # the first prompt's first two blocks (8 tokens) are cached: a prompt sharing them reads them
    shared = prompts[0][:2 * BLOCK_SIZE]
    follow = shared + engine.tokenizer.encode(" and the cat").ids
    hit = request(10, follow, blocks[0][:2] + pool.take(len(follow) + max_new, BLOCK_SIZE),
                  max_new_tokens=max_new, ignore_eos=True)
    hit.cache_len = len(shared)
    assert run_to_completion(engine, [hit], batch_id=2)[10] == _greedy_reference(
        reference, follow, max_new)

    long = prompts[2] + prompts[1]
    long_blocks = pool.take(len(long) + max_new, BLOCK_SIZE)
    for start in range(0, len(long) - 3, 3):
        chunk = request(11, long, long_blocks, max_new_tokens=max_new, ignore_eos=True)
        chunk.cache_len, chunk.chunk_len = start, 3
        out = engine.prefill(20 + start, [chunk])
        assert out.generations == [] and out.batch is None, "a partial chunk yields nothing"
    last = request(11, long, long_blocks, max_new_tokens=max_new, ignore_eos=True)
    last.cache_len = start + 3
    assert run_to_completion(engine, [last], batch_id=3)[11] == _greedy_reference(
        reference, long, max_new)


def test_two_shards_give_the_logits_of_one(tiny_gemmas):
    """Gemma 3's 4 query heads and 2 key/value heads over 2 ranks (gloo): the q/k norms are
    replicated, the vocabulary and projections split. (Gemma 2 splits no differently: its soft
    caps act on whole scores and gathered logits.)"""
    model_dir = tiny_gemmas[3]
    (single,) = tensor_parallel_logits(model_dir, 1)
    for rank_logits in tensor_parallel_logits(model_dir, 2):
        assert (rank_logits - single).abs().max().item() <= 1e-4


def test_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (config under text_config, tensors under
    language_model.model.) loads through the registry as its language model: the logits of
    transformers' multimodal model on text alone, prefill and decode."""
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, query_pre_attn_scalar=24, sliding_window=4,
                layer_types=[SLIDING, FULL])
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=300,
                                       boi_token_index=301, eoi_token_index=302)
    reference = transformers.Gemma3ForConditionalGeneration(config).eval()
    reference.save_pretrained(tmp_path, safe_serialization=True)
    build_tokenizer(tmp_path)
    runner = _runner(tmp_path)
    assert runner.model.config.num_hidden_layers == 2
    prompt = [5, 17, 42, 99, 3, 250, 7, 11, 12]
    logits = runner.prefill([PrefillSequence(prompt, 0, [1, 2, 3, 4])], all_logits_rows={0})
    ours, tokens = [logits.full[0]], list(prompt)
    next_id = logits.last.argmax(-1)
    for _ in range(4):
        tokens.append(int(next_id))
        step = runner.decode(next_id, torch.tensor([len(tokens) - 1]),
                             torch.tensor([[1, 2, 3, 4]])).logits
        ours.append(step)
        next_id = step.argmax(-1)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    assert (torch.cat(ours) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("raw", [
    # as transformers 5 writes them
    {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 3,
     "layer_types": [SLIDING, FULL, SLIDING],
     "rope_parameters": {FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         SLIDING: {"rope_type": "default", "rope_theta": 1e4}}},
    # as older Gemma 3 checkpoints name them: a pattern, one theta per kind, a global scaling
    {"architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 2, "rope_theta": 5e5,
     "rope_local_base_freq": 2e4, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    # nothing but the required sizes: transformers' defaults (a 5:1 pattern, 1e6 and 1e4)
    {"architectures": ["Gemma3ForCausalLM"]},
    {"architectures": ["Gemma2ForCausalLM"], "rope_theta": 20000.0, "sliding_window": 7},
    {"architectures": ["Gemma2ForCausalLM"], "final_logit_softcapping": None,
     "attn_logit_softcapping": None},
], ids=["gemma3-v5", "gemma3-legacy", "gemma3-defaults", "gemma2-legacy", "gemma2-uncapped"])
def test_config_reads_as_transformers_reads_it(raw):
    import transformers

    generation = 3 if raw["architectures"][0].startswith("Gemma3") else 2
    sizes = {"num_hidden_layers": 7, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": TINY_VOCAB}
    raw = {**sizes, **raw}
    config_class = transformers.Gemma3TextConfig if generation == 3 else transformers.Gemma2Config
    theirs = config_class(**{k: v for k, v in raw.items() if k != "architectures"})
    ours = GemmaConfig.from_dict(raw, generation=generation)
    assert ours.layer_types == theirs.layer_types
    assert ours.sliding_window == theirs.sliding_window
    assert ours.attn_logit_softcapping == theirs.attn_logit_softcapping
    assert ours.final_logit_softcapping == theirs.final_logit_softcapping
    assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar
    rope = theirs.rope_parameters
    for kind in (SLIDING, FULL):
        expected = rope[kind] if generation == 3 else rope
        assert ours.rope[kind]["rope_theta"] == expected["rope_theta"]
        assert ours.rope[kind].get("rope_type", "default") == expected["rope_type"]
        assert ours.rope[kind].get("factor") == expected.get("factor")


def test_multimodal_gemma3_config_reads_its_text_config():
    raw = {"architectures": ["Gemma3ForConditionalGeneration"],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "model_type": "gemma3_text", "num_hidden_layers": 34,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152}}
    cfg = GemmaConfig.from_dict(raw, generation=3)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.vocab_size) == (2560, 8, 4, 256, 262208)
    assert cfg.layer_types.count(FULL) == 5 and cfg.layer_types[5] == FULL
    assert cfg.rope[FULL] == {"factor": 8.0, "rope_type": "linear", "rope_theta": 1e6}
    assert cfg.rope[SLIDING] == {"rope_theta": 1e4}


@pytest.mark.parametrize("raw,message", [
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "bidirectional"),
    ({"sliding_window": 0}, "attend to nothing"),
    ({"num_hidden_layers": 2, "layer_types": [SLIDING, "chunked_attention"]}, "layer_types"),
])
def test_config_refuses_what_it_cannot_serve(raw, message):
    with pytest.raises(ValueError, match=message):
        GemmaConfig.from_dict(raw, generation=3)
