"""Synthetic GGUFs of real models' shapes: random Q4_K_M blocks, the default model's tokenizer.

A step's cost and a server's memory depend on the shapes and the tensor types, not on the values.
The types are llama.cpp's Q4_K_M choice (llama-quant.cpp): Q4_K everywhere but the output head
(Q6_K; a tied embedding is the head) and attn_v and ffn_down in the layers it gives more bits (the
first and last eighth, and every third one between), which are Q6_K. Blocks are random bytes with small factors (weights of
a few hundredths), the vocabulary SmolLM2's padded with plain tokens to the shape's size.

    python benchmarks/gguf_shapes.py --shape llama3.2-1b --out /tmp/llama-1b-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "llama3.2-1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                        tied=True),
    "llama3.2-3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256,
                        tied=True),
    "llama3-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                      tied=False),
}
Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M
# each type's float16 factors (byte offsets in its block) and their size
_FACTORS = {"Q4_K": ((0, 5e-5), (2, 5e-5)), "Q6_K": ((208, 1e-5),)}


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def tensors(shape: dict) -> list[tuple[str, tuple[int, int], str]]:
    """(GGUF name, (rows, columns), ggml type) of every matrix, in llama.cpp's order."""
    h, kv = shape["hidden"], shape["kv_heads"] * shape["hidden"] // shape["heads"]
    # a tied embedding is the output head too: llama.cpp gives it the head's type
    out = [("token_embd.weight", (shape["vocab"], h), "Q6_K" if shape["tied"] else "Q4_K")]
    for i in range(shape["layers"]):
        wide = "Q6_K" if more_bits(i, shape["layers"]) else "Q4_K"
        out += [(f"blk.{i}.attn_q.weight", (h, h), "Q4_K"),
                (f"blk.{i}.attn_k.weight", (kv, h), "Q4_K"),
                (f"blk.{i}.attn_v.weight", (kv, h), wide),
                (f"blk.{i}.attn_output.weight", (h, h), "Q4_K"),
                (f"blk.{i}.ffn_gate.weight", (shape["ffn"], h), "Q4_K"),
                (f"blk.{i}.ffn_up.weight", (shape["ffn"], h), "Q4_K"),
                (f"blk.{i}.ffn_down.weight", (h, shape["ffn"]), wide)]
    if not shape["tied"]:
        out.append(("output.weight", (shape["vocab"], h), "Q6_K"))
    return out


def random_blocks(kind: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    import gguf

    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows * columns // values, size), dtype=np.uint8)
    for at, scale in _FACTORS[kind]:
        factor = (rng.random(blocks.shape[0]) * scale + scale / 4).astype(np.float16)
        blocks[:, at:at + 2] = factor.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, columns // values * size)


def write(shape_name: str, out: Path, tokenizer_gguf: Path, seed: int = 0) -> Path:
    """The synthetic file at `out` (its tokenizer and chat template from `tokenizer_gguf`)."""
    import gguf

    from launcher.gguf_file import read_gguf

    shape = SHAPES[shape_name]
    source = read_gguf(tokenizer_gguf).metadata
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"synthetic {shape_name} Q4_K_M")
    writer.add_file_type(Q4_K_M)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape["vocab"])
    tokens = list(source["tokenizer.ggml.tokens"])
    types = list(source["tokenizer.ggml.token_type"])
    padding = shape["vocab"] - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(str(source.get("tokenizer.ggml.pre", "default")))
    writer.add_token_list(tokens + [f"<|unused_{i}|>" for i in range(padding)])
    # plain tokens: a random model picks them, and every server must print them as text
    writer.add_token_types(types + [gguf.TokenType.NORMAL] * padding)
    writer.add_token_merges(list(source["tokenizer.ggml.merges"]))
    for key, add in (("bos_token_id", writer.add_bos_token_id),
                     ("eos_token_id", writer.add_eos_token_id),
                     ("padding_token_id", writer.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in source:
            add(int(source[f"tokenizer.ggml.{key}"]))
    if "tokenizer.chat_template" in source:
        writer.add_chat_template(source["tokenizer.chat_template"])
    matrices = tensors(shape)
    norms = [f"blk.{i}.{n}.weight" for i in range(shape["layers"])
             for n in ("attn_norm", "ffn_norm")] + ["output_norm.weight"]
    for name in norms:
        writer.add_tensor_info(name, (shape["hidden"],), np.dtype(np.float32),
                               shape["hidden"] * 4)
    for name, (rows, columns), kind in matrices:
        kind_type = gguf.GGMLQuantizationType[kind]
        values, size = gguf.GGML_QUANT_SIZES[kind_type]
        writer.add_tensor_info(name, (rows, columns // values * size),
                               np.dtype(np.uint8), rows * columns // values * size,
                               raw_dtype=kind_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _ in norms:
        writer.write_tensor_data(np.ones(shape["hidden"], dtype=np.float32))
    for _, (rows, columns), kind in matrices:
        writer.write_tensor_data(random_blocks(kind, rows, columns, rng))
    writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer-gguf", type=Path, default=None,
                        help="where the tokenizer comes from (default: the default model's GGUF)")
    args = parser.parse_args()
    if args.tokenizer_gguf is None:
        from launcher.known_models import DEFAULT_MODEL
        from launcher.model_cache import cache_root
        from launcher.prepare import fetch_gguf

        args.tokenizer_gguf = fetch_gguf(DEFAULT_MODEL, cache_root())
    path = write(args.shape, args.out, args.tokenizer_gguf)
    print(f"{path}: {path.stat().st_size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
