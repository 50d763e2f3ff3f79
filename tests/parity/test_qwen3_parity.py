"""Qwen3 and Qwen3-MoE against `transformers` on tiny random weights: logits through the paged
cache, greedy tokens through the engine (a prefix-cache hit and a chunked prompt among them), and
two tensor-parallel ranks (attention heads split, experts split whole) against one."""
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp

from shard.distributed import ParallelContext
from shard.kv_budget import KVCacheSpec
from shard.loader import load_model
from shard.model_runner import DecodePath, ModelRunner, PrefillSequence
from shard.weights import Weights
from tests.engine_helpers import make_engine, request, run_to_completion
from tests.tiny_models import TINY_VOCAB, build_tokenizer

BLOCK_SIZE = 4
DECODE_STEPS = 16
WINDOW = 5  # shorter than every prompt below: the sliding layers drop keys in prefill and decode
CHUNK = 7  # a chunked prompt's chunks: longer than the window

VARIANTS = {
    # layers 1 and 2 slide (from max_window_layers on), layer 0 attends to everything; the head
    # tied to the embeddings, as the small Qwen3s have it
    "qwen3": dict(moe=False, sliding=True, tie_word_embeddings=True),
    # the experts as the Hub stores them, one tensor per projection; layer 1 dense
    # (mlp_only_layers), the top-2 weights renormalised
    "qwen3-moe": dict(moe=True),
    # the experts fused as transformers 5 holds them ([experts, 2 * inter, hidden]); every layer
    # slides, every layer sparse, the top-2 weights as the softmax gave them
    "qwen3-moe-fused": dict(moe=True, fused_experts=True, sliding=True, norm_topk_prob=False,
                            mlp_only_layers=[]),
}


def build_tiny_qwen3(out_dir, *, moe: bool, sliding: bool = False, fused_experts: bool = False,
                     norm_topk_prob: bool = True, mlp_only_layers=(1,),
                     tie_word_embeddings: bool = False, seed: int = 0, tokenizer_from=None):
    """A random Qwen3 (moe: Qwen3-MoE with 4 experts, 2 per token) of 3 layers, hidden 64, with the
    tiny tokenizer (copied from the model directory `tokenizer_from`, else trained)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                  eos_token_id=2, pad_token_id=2, tie_word_embeddings=tie_word_embeddings,
                  use_sliding_window=sliding, sliding_window=WINDOW,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if moe:
        config = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32,
                                             norm_topk_prob=norm_topk_prob,
                                             mlp_only_layers=list(mlp_only_layers), **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen3Config(max_window_layers=1, **common)
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # ones: make them count
                param.normal_(1.0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                # the default init's router is near uniform, where a 1e-7 difference could swap
                # two experts: spread out, each token has a clear choice
                param.normal_(0, 0.5)
    # transformers 5 saves the experts per expert (the Hub's form) unless told to keep its own
    model.eval().save_pretrained(out_dir, save_original_format=not fused_experts)
    if tokenizer_from is None:
        build_tokenizer(out_dir)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}
    for name, variant in VARIANTS.items():
        built[name] = build_tiny_qwen3(tmp_path_factory.mktemp(name), **variant,
                                       tokenizer_from=next(iter(built.values()), None))
    return built


def _reference(model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _runner(model_dir):
    loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                        parallel=ParallelContext())
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, BLOCK_SIZE,
                       torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, spec)
    runner.allocate(64)
    return runner


def test_the_configs_read_as_transformers_reads_them(models):
    from shard.models.qwen3 import qwen3_layer_windows

    qwen3 = load_model(models["qwen3"], dtype=torch.float32, device=torch.device("cpu"),
                       parallel=ParallelContext()).config
    assert qwen3.layer_windows == (None, WINDOW, WINDOW)
    assert not qwen3.qkv_bias and not qwen3.o_bias
    moe = load_model(models["qwen3-moe"], dtype=torch.float32, device=torch.device("cpu"),
                     parallel=ParallelContext()).config
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (4, 2, True)
    assert moe.sparse_layers == (True, False, True)
    assert moe.layer_windows == (None, None, None)  # use_sliding_window false: no window
    # a Hub config: num_experts, sliding_window named but off, every other layer sparse
    from shard.models.qwen3_moe import Qwen3MoeConfig

    hub = Qwen3MoeConfig.from_dict({
        "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3],
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2})
    assert hub.num_experts == 8 and hub.sparse_layers == (False, True, False, False)
    assert hub.layer_windows == (None,) * 4
    assert qwen3_layer_windows({"num_hidden_layers": 3, "use_sliding_window": True,
                                "sliding_window": 7, "layer_types": [
                                    "sliding_attention", "full_attention",
                                    "sliding_attention"]}) == (7, None, 7)


@pytest.mark.parametrize("name,kernel", [
    ("qwen3", True), ("qwen3", False), ("qwen3-moe", True), ("qwen3-moe", False),
    # the experts' layout is the only difference: one attention path is enough
    ("qwen3-moe-fused", True)])
def test_logits_match_transformers_through_paged_cache(models, name, kernel):
    model_dir = models[name]
    runner, reference = _runner(model_dir), _reference(model_dir)
    if kernel and not runner.paged_kernel:
        pytest.skip("no C compiler here: decode attention stays in PyTorch")
    runner.paged_kernel = kernel
    assert runner.decode_path(1) is DecodePath.EAGER, "the C step takes Llama alone"
    prompts = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13, 14, 15, 16],
               [200, 201, 202, 203, 204, 205, 206, 207, 208]]
    # blocks deliberately out of order and interleaved between sequences
    blocks = [[9, 3, 14, 1, 20, 30, 31], [2, 8, 13, 21, 22, 23], [4, 5, 6, 7, 10, 11, 12, 15]]
    seqs = [PrefillSequence(p, 0, b) for p, b in zip(prompts, blocks)]
    logits = runner.prefill(seqs, all_logits_rows={0, 1, 2})
    ours = [list(logits.full[i]) for i in range(len(prompts))]
    tokens = [list(p) for p in prompts]
    next_ids = logits.last.argmax(-1)
    seq_lens = torch.tensor([len(p) for p in prompts])
    block_tables = torch.tensor([b + [0] * (8 - len(b)) for b in blocks])
    for _ in range(DECODE_STEPS):
        for row, token in enumerate(next_ids.tolist()):
            tokens[row].append(token)
        step = runner.decode(next_ids, seq_lens, block_tables).logits
        for row in range(len(prompts)):
            ours[row].append(step[row])
        seq_lens, next_ids = seq_lens + 1, step.argmax(-1)
    # causal: transformers' logits at each position of the whole sequence are each step's
    with torch.no_grad():
        for row, seq in enumerate(tokens):
            expected = reference(torch.tensor([seq])).logits[0]
            assert (torch.stack(ours[row]) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe"])
def test_engine_greedy_tokens_match_transformers_generate(models, name):
    """Alone, then its prompt's first blocks found in the cache (a prefix-cache hit), then in
    chunks that each read the ones before from the cache: the tokens of transformers' greedy
    generate every time."""
    model_dir = models[name]
    engine, reference = make_engine(model_dir, block_size=BLOCK_SIZE), _reference(model_dir)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.").ids
    other = engine.tokenizer.encode("The quick brown fox jumps over the capital of France").ids
    shared = 5 * BLOCK_SIZE  # whole blocks of the prompts' common start
    assert prompt[:shared] == other[:shared] and len(other) > shared + CHUNK
    new = 12
    with torch.no_grad():
        expected = {tuple(p): reference.generate(
            torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=2)[0, len(p):].tolist() for p in (prompt, other)}
    free = iter(range(1, 200))

    def blocks(ids):
        return [next(free) for _ in range(-(-(len(ids) + new) // BLOCK_SIZE))]

    def answer(rid, ids, held, **fields):
        req = request(rid, ids, held, max_new_tokens=new, ignore_eos=True)
        for key, value in fields.items():
            setattr(req, key, value)
        return run_to_completion(engine, [req], batch_id=rid)[rid]

    first_blocks = blocks(prompt)
    assert answer(1, prompt, first_blocks) == expected[tuple(prompt)]
    # the shared tokens' keys and values sit in the first request's first blocks
    hit_blocks = first_blocks[:shared // BLOCK_SIZE] + blocks(other)[shared // BLOCK_SIZE:]
    assert answer(2, other, hit_blocks, cache_len=shared) == expected[tuple(other)]
    chunk_blocks = blocks(other)
    for start in range(0, len(other) - CHUNK, CHUNK):
        chunk = request(3, other, chunk_blocks, max_new_tokens=new, ignore_eos=True)
        chunk.cache_len, chunk.chunk_len = start, CHUNK
        out = engine.prefill(100 + start, [chunk])
        assert out.generations == [] and out.batch is None, "a partial chunk yields nothing"
    assert answer(4, other, chunk_blocks, cache_len=start + CHUNK) == expected[tuple(other)]


def test_experts_grouped_equal_every_expert_over_every_row_and_trace_whole(models):
    """The form a CUDA graph or a whole-graph trace takes (no host read of the routing) gives the
    grouped form's sum, and traces without a break."""
    model = _runner(models["qwen3-moe"]).model
    block = model.layers[0].mlp
    x = torch.randn(7, 64)
    weights, experts = block.route(x)
    assert torch.allclose(weights.sum(-1), torch.ones(7))  # norm_topk_prob
    grouped = block._grouped(x, weights, experts)
    assert (block._every_expert(x, weights, experts) - grouped).abs().max().item() <= 1e-6
    traced = torch.compile(block, fullgraph=True, backend="eager", dynamic=False)
    assert (traced(x) - grouped).abs().max().item() <= 1e-6


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen3-moe-fused"])
def test_each_rank_holds_its_own_experts_whole_and_a_split_they_do_not_fit_is_refused(models,
                                                                                       name):
    from shard.layers.moe import SparseMoeBlock

    def rank_weights(rank, world):
        return Weights(models[name], dtype=torch.float32, device=torch.device("cpu"),
                       parallel=ParallelContext(rank=rank, world_size=world))

    def load(weights):
        return SparseMoeBlock.load(weights, "model.layers.0.mlp", num_experts=4, top_k=2,
                                   intermediate_size=32, norm_topk_prob=True)

    full = rank_weights(0, 1)
    prefix = "model.layers.0.mlp.experts"
    for rank in range(2):
        block = load(rank_weights(rank, 2))
        assert block.first_expert == 2 * rank and len(block.experts) == 2
        assert torch.equal(block.gate.prepared.weight, full.get("model.layers.0.mlp.gate.weight"))
        for index, expert in enumerate(block.experts, start=2 * rank):
            if name.endswith("fused"):
                gate_up = full.get(f"{prefix}.gate_up_proj")[index]
                down = full.get(f"{prefix}.down_proj")[index]
            else:
                gate_up = torch.cat([full.get(f"{prefix}.{index}.gate_proj.weight"),
                                     full.get(f"{prefix}.{index}.up_proj.weight")])
                down = full.get(f"{prefix}.{index}.down_proj.weight")
            assert torch.equal(expert.gate_up_proj.prepared.weight, gate_up)
            assert torch.equal(expert.down_proj.prepared.weight, down)
    with pytest.raises(ValueError, match="3 shards do not divide the model's 4 experts"):
        load(rank_weights(0, 3))


PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13]]
PROMPT_BLOCKS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
TP_STEPS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_logits(rank: int, world: int, port: int, model_dirs: dict, results):
    """Prefill and TP_STEPS greedy decode steps of each model on this rank; its logits stacked."""
    from shard.distributed import init_parallel

    torch.set_num_threads(1)
    parallel = (init_parallel(rank=rank, world_size=world, master_addr="127.0.0.1",
                              master_port=port, device=torch.device("cpu"))
                if world > 1 else ParallelContext())
    for name, model_dir in model_dirs.items():
        loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                            parallel=parallel)
        cfg = loaded.config
        runner = ModelRunner(loaded.model, KVCacheSpec(
            cfg.num_hidden_layers, cfg.num_key_value_heads // world, cfg.head_dim, BLOCK_SIZE,
            torch.float32, torch.device("cpu")))
        runner.allocate(16)
        step = runner.prefill([PrefillSequence(p, 0, b)
                               for p, b in zip(PROMPTS, PROMPT_BLOCKS)]).last
        logits = [step]
        seq_lens = torch.tensor([len(p) for p in PROMPTS])
        tables = torch.tensor(PROMPT_BLOCKS)
        for _ in range(TP_STEPS):
            step = runner.decode(step.argmax(-1), seq_lens, tables).logits
            logits.append(step)
            seq_lens = seq_lens + 1
        results[name, rank] = torch.stack(logits)
        if world > 1 and name.startswith("qwen3-moe"):
            assert len(loaded.model.layers[0].mlp.experts) == cfg.num_experts // world
    if world > 1:
        torch.distributed.destroy_process_group()


def test_two_shards_give_one_shards_logits(models, tmp_path):
    """Heads and dense MLPs split by rows and columns, experts split whole (two each): every rank's
    logits are the single rank's; also with the experts a GPTQ checkpoint's, quantized one by
    one (a native GGUF's experts: tests/unit/shard/test_gguf_moe.py)."""
    from tests.quantized_checkpoints import quantized_model

    dirs = {name: str(models[name]) for name in ("qwen3", "qwen3-moe")}
    quantized_model(models["qwen3-moe"], tmp_path / "gptq", tmp_path / "reference", method="gptq")
    dirs["qwen3-moe-gptq"] = str(tmp_path / "gptq")
    single = {}
    _rank_logits(0, 1, 0, dirs, single)
    sharded = mp.Manager().dict()
    mp.spawn(_rank_logits, args=(2, _free_port(), dirs, sharded), nprocs=2)
    for name in dirs:
        for rank in range(2):
            assert (sharded[name, rank] - single[name, 0]).abs().max().item() <= 1e-4
