"""Tensor parallelism on CPU (gloo): each rank's slices; logits and BERT embeddings as on one."""
import socket

import pytest
import torch
import torch.multiprocessing as mp

from shard.distributed import ParallelContext
from shard.weights import Weights
from tests.tiny_models import build_tiny_model

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13]]
BLOCKS = [[1, 2, 3, 4, 5], [6, 7, 8, 9]]
DECODE_STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, world: int, port: int, model_dir: str, results,
              adapter_dir: str | None = None):
    from shard.distributed import init_parallel
    from shard.kv_budget import KVCacheSpec
    from shard.loader import load_model
    from shard.model_runner import ModelRunner, PrefillSequence

    torch.set_num_threads(1)
    parallel = init_parallel(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                             device=torch.device("cpu"))
    loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"), parallel=parallel)
    cfg = loaded.config
    runner = ModelRunner(loaded.model, KVCacheSpec(cfg.num_hidden_layers,
                                                   cfg.num_key_value_heads // world, cfg.head_dim,
                                                   4, torch.float32, torch.device("cpu")))
    runner.allocate(16)
    # with an adapter: the first sequence takes it, the second is the base model's
    slots = [-1, -1]
    if adapter_dir is not None:
        slots[0] = runner.adapters.load("lora", adapter_dir).slot
    last = runner.prefill([PrefillSequence(p, 0, b, adapter_slot=s)
                           for p, b, s in zip(PROMPTS, BLOCKS, slots)]).last
    logits = [last]
    next_ids = last.argmax(-1)
    seq_lens = torch.tensor([len(p) for p in PROMPTS])
    tables = torch.tensor([b + [0] * (5 - len(b)) for b in BLOCKS])
    for _ in range(DECODE_STEPS):
        step = runner.decode(next_ids, seq_lens, tables,
                             torch.tensor(slots) if adapter_dir is not None else None).logits
        logits.append(step)
        next_ids, seq_lens = step.argmax(-1), seq_lens + 1
    results[rank] = torch.stack(logits)
    if world > 1:
        torch.distributed.destroy_process_group()


def assert_two_ranks_give_one_ranks(run_rank, model_dir) -> None:
    """run_rank(rank, world, port, model_dir, results) on one rank, then on two (spawned): each of
    the two ranks' results within 1e-4 of the one rank's."""
    single: dict = {}
    run_rank(0, 1, 0, str(model_dir), single)
    results = mp.Manager().dict()
    mp.spawn(run_rank, args=(2, _free_port(), str(model_dir), results), nprocs=2)
    for rank in range(2):
        assert (results[rank] - single[0]).abs().max().item() <= 1e-4


def _logits(model_dir, world: int, adapter_dir=None) -> list[torch.Tensor]:
    results = mp.Manager().dict() if world > 1 else {}
    adapter = None if adapter_dir is None else str(adapter_dir)
    if world == 1:
        _run_rank(0, 1, 0, str(model_dir), results, adapter)
    else:
        mp.spawn(_run_rank, args=(world, _free_port(), str(model_dir), results, adapter),
                 nprocs=world)
    return [results[r] for r in range(world)]


@pytest.mark.parametrize("world,heads,kv_heads", [(2, 4, 2), (2, 4, 4)])
def test_sharded_logits_equal_one_shard(tmp_path, world, heads, kv_heads):
    model_dir = build_tiny_model(tmp_path / "model", num_heads=heads, num_kv_heads=kv_heads)
    (single,) = _logits(model_dir, 1)
    for rank_logits in _logits(model_dir, world):
        assert (rank_logits - single).abs().max().item() <= 1e-4


def test_sharded_lora_equals_one_shard(tmp_path):
    """Each rank holds its slices of the adapter (lora_B split as a column-parallel layer's rows,
    lora_A as a row-parallel layer's columns); the logits equal one shard's, and the adapter's
    row differs from the base model's."""
    from tests.lora_adapters import build_adapter

    model_dir = build_tiny_model(tmp_path / "model", num_heads=4, num_kv_heads=2)
    adapter_dir = build_adapter(model_dir, tmp_path / "adapter", rank=8, alpha=16, std=0.1)
    (single,) = _logits(model_dir, 1, adapter_dir)
    (base,) = _logits(model_dir, 1)
    assert (single[0, 0] - base[0, 0]).abs().max().item() > 0.05
    assert torch.equal(single[0, 1], base[0, 1])
    for rank_logits in _logits(model_dir, 2, adapter_dir):
        assert (rank_logits - single).abs().max().item() <= 1e-4


def test_each_rank_reads_only_its_slices(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model", num_heads=4, num_kv_heads=2)
    cpu = torch.device("cpu")
    full = Weights(model_dir, dtype=torch.float32, device=cpu, parallel=ParallelContext())
    q = full.get("model.layers.0.self_attn.q_proj.weight")
    o = full.get("model.layers.0.self_attn.o_proj.weight")
    for rank in range(2):
        part = Weights(model_dir, dtype=torch.float32, device=cpu,
                       parallel=ParallelContext(rank=rank, world_size=2))
        assert torch.equal(part.get_sharded("model.layers.0.self_attn.q_proj.weight", dim=0),
                           q[rank * 32:(rank + 1) * 32])
        assert torch.equal(part.get_sharded("model.layers.0.self_attn.o_proj.weight", dim=1),
                           o[:, rank * 32:(rank + 1) * 32])
    with pytest.raises(ValueError, match="does not divide by 3 shards"):
        Weights(model_dir, dtype=torch.float32, device=cpu,
                parallel=ParallelContext(rank=0, world_size=3)).get_sharded(
            "model.layers.0.self_attn.k_proj.weight", dim=0)


def _rank_bert_vectors(rank: int, world: int, port: int, model_dir: str, results):
    """The tiny BERT's pooled vectors of inputs of several lengths, padded together, on a rank."""
    from pathlib import Path

    from shard.distributed import init_parallel
    from shard.embedder import Embedder
    from shard.kv_budget import KVCacheSpec
    from shard.loader import load_model
    from shard.pooling import read_pooling

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    parallel = init_parallel(rank=rank, world_size=world, master_addr="127.0.0.1",
                             master_port=port, device=cpu)
    loaded = load_model(Path(model_dir), dtype=torch.float32, device=cpu, parallel=parallel)
    cfg = loaded.config
    spec = KVCacheSpec(cfg.num_hidden_layers, loaded.heads.num_kv_heads, cfg.head_dim, 4,
                       torch.float32, cpu)
    embedder = Embedder(loaded.model, spec, read_pooling(Path(model_dir), {}), cfg.vocab_size,
                        cfg.max_position_embeddings)
    out = embedder.embed([(i, prompt) for i, prompt in enumerate(PROMPTS + [[1] * 40])])
    assert not out.rejected, out.rejected
    results[rank] = torch.stack([out.vectors[i] for i in range(len(PROMPTS) + 1)])
    if world > 1:
        torch.distributed.destroy_process_group()


def test_a_bert_on_two_ranks_embeds_as_on_one(tmp_path):
    """Each rank holds half the heads and half the feed-forward block; the row-parallel layers'
    biases are added once, after the sum of the ranks."""
    from tests.embedding_models import build_tiny_bert

    model_dir = build_tiny_bert(tmp_path / "bert")
    assert_two_ranks_give_one_ranks(_rank_bert_vectors, model_dir)


@pytest.mark.real_model
def test_smollm2_logits_on_three_shards_equal_one_shard(real_model_dir):
    """SmolLM2 has 9 attention heads and 3 KV heads: 3 shards of 3 and 1 each."""
    (single,) = _logits(real_model_dir, 1)
    for rank_logits in _logits(real_model_dir, 3):
        assert (rank_logits - single).abs().max().item() <= 1e-4
