"""Phi-3 (fused q/k/v and gate/up tensors, LongRoPE, partial rotation, sliding window) and Mistral's
sliding window against `transformers` on tiny random weights: logits through the paged cache,
greedy answers through the engine (prefix cache, chunked prefill), and two tensor-parallel ranks."""
import shutil

import pytest
import torch

from shard.distributed import ParallelContext
from shard.kv_budget import KVCacheSpec
from shard.loader import load_model
from shard.model_runner import ModelRunner, PrefillSequence
from shard.models.phi3 import Phi3Config
from shard.weights import Weights
from tests.engine_helpers import make_engine, request, run_to_completion
from tests.parity.test_tensor_parallel import _logits as tensor_parallel_logits
from tests.tiny_models import TINY_VOCAB, build_tokenizer

BLOCK_SIZE = 4
DECODE_STEPS = 16
HEAD_DIM = 16
ORIGINAL_POSITIONS = 64  # LongRoPE's original_max_position_embeddings: every test stays below it


def _save(model, out_dir, tokenizer_dir):
    with torch.no_grad():  # random init leaves the norms at one: make them count
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def _common(num_heads=4, num_kv_heads=2, tie_word_embeddings=False):
    return dict(vocab_size=TINY_VOCAB, hidden_size=num_heads * HEAD_DIM, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=num_heads,
                num_key_value_heads=num_kv_heads, max_position_embeddings=512, rms_norm_eps=1e-5,
                tie_word_embeddings=tie_word_embeddings, bos_token_id=1, eos_token_id=2,
                pad_token_id=2)


def build_tiny_phi3(out_dir, tokenizer_dir, *, longrope=False, partial=1.0,
                    sliding_window=None, tie_word_embeddings=False, seed=0):
    import transformers

    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}
    if longrope:  # factors far from one, and apart: a set used in the wrong place shows
        pairs = int(HEAD_DIM * partial) // 2
        rope.update(rope_type="longrope", short_factor=torch.linspace(1.0, 3.0, pairs).tolist(),
                    long_factor=torch.linspace(2.0, 9.0, pairs).tolist())
    config = transformers.Phi3Config(rope_parameters=rope, sliding_window=sliding_window,
                                     original_max_position_embeddings=ORIGINAL_POSITIONS,
                                     **_common(tie_word_embeddings=tie_word_embeddings))
    return _save(transformers.Phi3ForCausalLM(config), out_dir, tokenizer_dir)


def build_tiny_mistral(out_dir, tokenizer_dir, *, sliding_window, seed=0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.MistralConfig(sliding_window=sliding_window, **_common())
    return _save(transformers.MistralForCausalLM(config), out_dir, tokenizer_dir)


def _runner(model_dir, kernel):
    loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                        parallel=ParallelContext())
    cfg = loaded.config
    runner = ModelRunner(loaded.model, KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                   cfg.head_dim, BLOCK_SIZE, torch.float32,
                                                   torch.device("cpu")))
    runner.allocate(64)
    if kernel and not runner.paged_kernel:
        pytest.skip("no C compiler here: decode attention stays in PyTorch")
    runner.paged_kernel = kernel
    return runner


def _reference(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _check_prefill_and_decode(runner, reference):
    """Three prompts prefilled together (blocks out of order), then DECODE_STEPS steps: every
    position's logits within 1e-4 of transformers' forward over the whole sequence (one forward
    per sequence at the end: a causal model's logits at a position depend on those before only)."""
    prompts = [[5, 17, 42, 99, 3, 250, 7], [11, 12], [200, 201, 202, 203, 204, 205, 206, 207, 208]]
    blocks = [[9, 3, 14, 1, 20, 30, 31], [2, 8, 13, 21, 22, 23], [4, 5, 6, 7, 10, 11, 12, 15]]
    prefill = runner.prefill([PrefillSequence(p, 0, b) for p, b in zip(prompts, blocks)],
                             all_logits_rows={0, 1, 2})
    tokens = [list(p) for p in prompts]
    steps = []
    next_ids = prefill.last.argmax(-1)
    seq_lens = torch.tensor([len(p) for p in prompts])
    block_tables = torch.tensor([b + [0] * (8 - len(b)) for b in blocks])
    for _ in range(DECODE_STEPS):
        for row, token in enumerate(next_ids.tolist()):
            tokens[row].append(token)
        steps.append(runner.decode(next_ids, seq_lens, block_tables).logits)
        seq_lens = seq_lens + 1
        next_ids = steps[-1].argmax(-1)
    assert max(len(t) for t in tokens) < ORIGINAL_POSITIONS
    with torch.no_grad():
        for row, seq in enumerate(tokens):
            expected = reference(torch.tensor([seq])).logits[0]
            ours = torch.cat([prefill.full[row], torch.stack([step[row] for step in steps])])
            assert (ours - expected[:len(ours)]).abs().max().item() <= 1e-4


PHI3_VARIANTS = {
    "plain": {},
    "longrope": dict(longrope=True),
    # Phi-4-mini's shape: three quarters of each head rotate, LongRoPE, tied head; and a window
    # shorter than the prompts
    "partial-longrope-tied-window": dict(longrope=True, partial=0.75, tie_word_embeddings=True,
                                         sliding_window=6),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_dir):
    """name -> the directory of that tiny model (a PHI3_VARIANTS name, or "mistral-window"),
    built once for the module."""
    built = {}

    def get(name):
        if name not in built:
            out = tmp_path_factory.mktemp(name)
            built[name] = (build_tiny_mistral(out, tokenizer_dir, sliding_window=5)
                           if name == "mistral-window"
                           else build_tiny_phi3(out, tokenizer_dir, **PHI3_VARIANTS[name]))
        return built[name]

    return get


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "pytorch-attention"])
@pytest.mark.parametrize("variant", list(PHI3_VARIANTS))
def test_phi3_logits_match_transformers_through_paged_cache(tiny, variant, kernel):
    model_dir = tiny(variant)
    _check_prefill_and_decode(_runner(model_dir, kernel), _reference(model_dir))


@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "pytorch-attention"])
def test_mistral_sliding_window_matches_transformers(tiny, kernel):
    """A window of 5 behind prompts of up to 9 tokens and 16 decode steps; then a prompt whose
    second part reads its window from the cached first part."""
    model_dir = tiny("mistral-window")
    runner, reference = _runner(model_dir, kernel), _reference(model_dir)
    assert runner.model.layers[0].self_attn.window == 5
    _check_prefill_and_decode(runner, reference)
    prompt = list(range(30, 41))
    runner.prefill([PrefillSequence(prompt[:6], 0, [40, 41, 42])])
    full = runner.prefill([PrefillSequence(prompt[6:], 6, [40, 41, 42])], all_logits_rows={0}).full
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0, 6:]
    assert (full[0] - expected).abs().max().item() <= 1e-4


def _greedy(reference, prompt, steps):
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def test_phi3_engine_answers_like_transformers_whole_chunked_and_from_a_cached_prefix(tiny):
    model_dir = tiny("partial-longrope-tied-window")
    engine, reference = make_engine(model_dir, block_size=BLOCK_SIZE), _reference(model_dir)
    shared = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]  # three whole blocks
    first, second = shared + [60, 61, 62, 63, 64], shared + [70, 71, 72]
    expected = {1: _greedy(reference, first, 8), 2: _greedy(reference, second, 8)}
    first_blocks = list(range(1, 8))
    assert run_to_completion(engine, [request(1, first, first_blocks, max_new_tokens=8,
                                              ignore_eos=True)]) == {1: expected[1]}
    # the second prompt's first three blocks are the first's, which hold their keys already
    cached = request(2, second, first_blocks[:3] + [20, 21, 22, 23], max_new_tokens=8,
                     ignore_eos=True)
    cached.cache_len = len(shared)
    assert run_to_completion(engine, [cached], batch_id=2) == {2: expected[2]}
    # the first prompt again, in chunks of 5, each reading the ones before from the cache
    blocks = list(range(30, 37))
    for start in range(0, len(first) - 5, 5):
        chunk = request(3, first, blocks, max_new_tokens=8, ignore_eos=True)
        chunk.cache_len, chunk.chunk_len = start, 5
        out = engine.prefill(10 + start, [chunk])
        assert out.generations == [] and out.batch is None
    last = request(3, first, blocks, max_new_tokens=8, ignore_eos=True)
    last.cache_len = start + 5
    assert run_to_completion(engine, [last], batch_id=30) == {3: expected[1]}


def test_phi3_on_two_ranks_equals_one(tiny):
    """Each rank takes its share of q, k and v (and of gate and up) out of the fused tensors,
    each query and key head reordered for its partial rotation; the vocabulary of the tied head
    split too."""
    model_dir = tiny("partial-longrope-tied-window")
    (single,) = tensor_parallel_logits(model_dir, 1)
    for rank_logits in tensor_parallel_logits(model_dir, 2):
        assert (rank_logits - single).abs().max().item() <= 1e-4


def test_fused_tensor_rows_each_rank_reads(tiny):
    from shard.layers.linear import fused_rows

    model_dir = tiny("plain")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    cpu = torch.device("cpu")
    whole = Weights(model_dir, dtype=torch.float32, device=cpu,
                    parallel=ParallelContext()).get(name)
    q, k, v = whole.split([64, 32, 32])
    for rank in range(2):
        part = Weights(model_dir, dtype=torch.float32, device=cpu,
                       parallel=ParallelContext(rank=rank, world_size=2))
        rows = fused_rows(part, name, [64, 32, 32])
        assert torch.equal(rows, torch.cat([q.chunk(2)[rank], k.chunk(2)[rank],
                                            v.chunk(2)[rank]]))
    with pytest.raises(ValueError, match="not the 64 \\+ 64 \\+ 32"):
        fused_rows(part, name, [64, 64, 32])


def test_rotation_of_each_position_is_transformers_short_or_long_one():
    """Positions below original_max_position_embeddings rotate as transformers rotates a short
    sequence, later ones as it rotates a long one (the choice in shard.layers.rotary); cos and sin
    carry the attention factor sqrt(1 + log(512 / 64) / log(64))."""
    import transformers
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from shard.layers.rotary import RotaryEmbedding

    pairs = HEAD_DIM // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": torch.linspace(1.0, 3.0, pairs).tolist(),
            "long_factor": torch.linspace(2.0, 9.0, pairs).tolist()}
    config = transformers.Phi3Config(rope_parameters=dict(rope),
                                     original_max_position_embeddings=ORIGINAL_POSITIONS,
                                     **_common())
    theirs = Phi3RotaryEmbedding(config)
    ours = RotaryEmbedding(HEAD_DIM, 512, 10000.0, {**rope, "original_max_position_embeddings": 64},
                           torch.float32, torch.device("cpu"))
    x = torch.zeros(1, 1, HEAD_DIM)
    short_cos, short_sin = theirs(x, torch.arange(ORIGINAL_POSITIONS)[None])
    long_cos, long_sin = theirs(x, torch.arange(200)[None])
    half = HEAD_DIM // 2
    assert torch.allclose(ours.cos[:64], short_cos[0], atol=1e-6)
    assert torch.allclose(ours.sin[:64, half:], short_sin[0, :, half:], atol=1e-6)
    assert torch.allclose(ours.cos[64:200], long_cos[0, 64:], atol=1e-5)
    assert torch.allclose(ours.sin[64:200, half:], long_sin[0, 64:, half:], atol=1e-5)
    assert not torch.allclose(short_cos[0, 1:], long_cos[0, 1:64], atol=1e-2)
    assert ours.cos[0, 0].item() == pytest.approx((1 + 3 / 6) ** 0.5)  # log 8 / log 64 = 1/2


def test_phi3_config_reads_the_older_form_like_the_newer():
    """Phi-3's first configs: rope_scaling of type "su", rope_theta, partial_rotary_factor and
    original_max_position_embeddings beside it; a window as long as the context is none."""
    short, long = [1.0] * 6, [4.0] * 6
    older = {"architectures": ["Phi3ForCausalLM"], **_common(), "rope_theta": 5000.0,
             "partial_rotary_factor": 0.75, "original_max_position_embeddings": 64,
             "rope_scaling": {"type": "su", "short_factor": short, "long_factor": long},
             "sliding_window": 512}
    newer = {**older, "rope_parameters": {"rope_type": "longrope", "rope_theta": 5000.0,
                                          "partial_rotary_factor": 0.75, "short_factor": short,
                                          "long_factor": long,
                                          "original_max_position_embeddings": 64}}
    for key in ("rope_theta", "partial_rotary_factor", "rope_scaling", "sliding_window"):
        del newer[key]
    a, b = Phi3Config.from_dict(older), Phi3Config.from_dict(newer)
    assert a.rotary_dim == b.rotary_dim == 12 and a.rope_theta == b.rope_theta == 5000.0
    assert a.sliding_window is b.sliding_window is None
    assert a.rope_scaling["original_max_position_embeddings"] == 64
    assert (a.rope_scaling["short_factor"], a.rope_scaling["long_factor"]) == (short, long)
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        Phi3Config.from_dict({**older, "hidden_act": "gelu"})


def test_the_shard_names_the_architecture_it_serves_in_its_info(tiny):
    from shard.__main__ import build_engine
    from shard.config import ShardConfig

    _, _, info, _ = build_engine(ShardConfig(model_path=str(tiny("plain")), dtype="float32",
                                          device="cpu"))
    assert info.architecture == "Phi3ForCausalLM"
