"""Embeddings against sentence-transformers: tiny random Qwen3-Embedding and BERT, all-MiniLM-L6-v2.

The shard's Embed path (build_engine's embedder) on the checkpoint's own pooling and tokenizer;
cosine >= 0.9999 on ten texts, as the router normalizes them.
"""
import torch

from tests.embedding_models import TEXTS, build_tiny_bert, build_tiny_qwen3_embedding



def _ours(model_dir, dtype: str = "float32") -> torch.Tensor:
    from router.inputs.tokenizer import RouterTokenizer
    from shard.__main__ import build_engine
    from shard.config import ShardConfig

    _, embedder, info, _ = build_engine(ShardConfig(model_path=str(model_dir), dtype=dtype,
                                                    uds_path="/tmp/tgi-py-embed-parity"))
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
