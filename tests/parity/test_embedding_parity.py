"""Embeddings against sentence-transformers: tiny random Qwen3-Embedding and BERT, all-MiniLM-L6-v2.

The shard's Embed path (build_engine's embedder) on the checkpoint's own pooling and tokenizer;
cosine >= 0.9999 on ten texts, as the router normalizes them. An encoder's --quantize int8
against its float32 embeddings, on one rank and on two.
"""
import socket

import torch
import torch.multiprocessing as mp

from shard.layers.int8_dynamic import _full_range
from tests.embedding_models import TEXTS, build_tiny_bert, build_tiny_qwen3_embedding


def _ours(model_dir, dtype: str = "float32", quantize: str = "", *, rank: int = 0,
          world_size: int = 1, master_port: int = 29500) -> torch.Tensor:
    from router.inputs.tokenizer import RouterTokenizer
    from shard.__main__ import build_engine
    from shard.config import ShardConfig

    _, embedder, info, _ = build_engine(ShardConfig(
        model_path=str(model_dir), dtype=dtype, quantize=quantize, rank=rank,
        world_size=world_size, master_port=master_port, uds_path="/tmp/tgi-py-embed-parity"))
    tokenizer = RouterTokenizer(str(model_dir))
    out = embedder.embed([(i, tokenizer.encode(t)) for i, t in enumerate(TEXTS)])
    assert not out.rejected
    vectors = torch.stack([out.vectors[i] for i in range(len(TEXTS))])
    return torch.nn.functional.normalize(vectors, dim=-1) if info.normalize else vectors


def _theirs(model_dir) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True, batch_size=4).float()


def _check(ours: torch.Tensor, theirs: torch.Tensor, floor: float) -> None:
    cosine = torch.nn.functional.cosine_similarity(ours, theirs)
    assert cosine.min().item() >= floor, cosine.tolist()


def test_a_tiny_qwen3_embedding_pools_its_last_token_as_sentence_transformers(tmp_path):
    model_dir = build_tiny_qwen3_embedding(tmp_path / "qwen3-embedding")
    theirs = _theirs(model_dir)
    assert torch.allclose(theirs.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-4)  # normalized
    _check(_ours(model_dir), theirs, 0.9999)


def test_a_tiny_bert_mean_pools_as_sentence_transformers(tmp_path):
    """The random BERT that test_tensor_parallel splits over two ranks, with no download."""
    model_dir = build_tiny_bert(tmp_path / "bert")
    _check(_ours(model_dir), _theirs(model_dir), 0.9999)


def test_all_minilm_l6_v2_from_pypi_matches_sentence_transformers(minilm_dir):
    theirs = _theirs(minilm_dir)
    _check(_ours(minilm_dir), theirs, 0.9999)
    _check(_ours(minilm_dir, "bfloat16"), theirs, 0.995)  # the CPU default dtype
    # fbgemm's int8 matmuls: at the least 0.9929 on these texts ("hello": [CLS] and [SEP] are
    # two thirds of its mean), 0.9968 on 40 sentences (benchmarks/RESULTS.md); with activations
    # in 7 bits (CPUs without AVX-512 VNNI, forced here) 0.9654 and 0.9903
    _check(_ours(minilm_dir, quantize="int8"), theirs, 0.99 if _full_range() else 0.96)


def test_a_tiny_bert_in_int8_embeds_as_in_float32(tmp_path):
    """The tiny BERT matches sentence-transformers in float32; in int8 its cosine to that is
    0.99955 at the least (0.99892 with activations in 7 bits), its weights drawn 10x the usual
    spread so that the layers' rounding shows."""
    model_dir = build_tiny_bert(tmp_path / "bert")
    theirs = _theirs(model_dir)
    _check(_ours(model_dir), theirs, 0.9999)
    _check(_ours(model_dir, quantize="int8"), theirs, 0.999 if _full_range() else 0.997)


def _embed_rank(rank: int, world: int, port: int, model_dir: str, results) -> None:
    torch.set_num_threads(1)
    results[rank] = _ours(model_dir, quantize="int8", rank=rank, world_size=world,
                          master_port=port)
    torch.distributed.destroy_process_group()


def test_an_int8_encoder_on_two_ranks_embeds_as_on_one(tmp_path):
    """Each rank rounds its own slice: the column-parallel layers as one rank does (the same
    rows of int8 weights, the same activations), the row-parallel ones each over its half of
    the inputs, so the two ranks' sum differs from one rank's by the rounding alone (0.99973
    at the least), and is as close to float32 as one rank's."""
    model_dir = build_tiny_bert(tmp_path / "bert")
    single = _ours(model_dir, quantize="int8")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_embed_rank, args=(2, port, str(model_dir), results), nprocs=2)
    assert torch.equal(results[0], results[1])
    _check(results[0], single, 0.999)
    _check(results[0], _ours(model_dir), 0.999 if _full_range() else 0.997)


def test_a_decoders_input_in_chunks_pools_as_the_whole(tmp_path):
    """Chunks over calls (keys and values kept under the input's id) give the whole's vector;
    a chunk that continues nothing kept is refused, and ClearCache's clear drops what is kept."""
    from shard.__main__ import build_engine
    from shard.config import ShardConfig
    from shard.embedder import EmbedInput

    model_dir = build_tiny_qwen3_embedding(tmp_path / "qwen3-embedding")
    _, embedder, _, _ = build_engine(ShardConfig(model_path=str(model_dir), dtype="float32",
                                                 uds_path="/tmp/tgi-py-embed-chunks"))
    ids = list(range(3, 40))
    whole = embedder.embed([(1, ids)]).vectors[1]
    for start, end in ((0, 10), (10, 11), (11, 30)):
        out = embedder.embed([EmbedInput(2, ids, start, end), (3, ids[:5])])
        assert set(out.vectors) == {3} and not out.rejected
    last = embedder.embed([EmbedInput(2, ids, 30, None)])
    assert torch.allclose(last.vectors[2], whole, atol=1e-5) and not embedder.chunked
    refused = embedder.embed([EmbedInput(4, ids, 10, 20)])
    assert [i for i, _ in refused.rejected] == [4]
    embedder.embed([EmbedInput(5, ids, 0, 10)])
    embedder.clear()
    assert not embedder.chunked
