"""A tiny Llama written as llama.cpp would: permuted q/k rows, mixed tensor types, a gpt2 vocabulary."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tests.tiny_models import build_tokenizer

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, CONTEXT = 2, 64, 4, 2, 96, 256
HEAD_DIM = HIDDEN // HEADS
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")

# Per layer, the ggml type of each tensor: every supported kind appears, q/k both raw and quantised.
_LAYER_TYPES = [
    {"attn_q": "F32", "attn_k": "F32", "attn_v": "F16", "attn_output": "Q4_1",
     "ffn_gate": "Q8_0", "ffn_up": "F32", "ffn_down": "Q4_1"},
    {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "F32", "attn_output": "F32",
     "ffn_gate": "F16", "ffn_up": "Q4_1", "ffn_down": "Q8_0"},
]
_HF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


@dataclass
class TinyGGUF:
    path: Path
    vocab: int
    # Hugging Face name -> the float32 values a correct conversion must produce
    expected: dict[str, np.ndarray] = field(default_factory=dict)
    # Hugging Face name -> ggml type name it was stored as
    types: dict[str, str] = field(default_factory=dict)


def permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf: rotate-half rows per head -> interleaved (re, im) pairs."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _stored(array: np.ndarray, type_name: str):
    """(data to write, raw_dtype, what dequantising it gives back)."""
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    if kind == gguf.GGMLQuantizationType.F32:
        return array, None, array
    if kind == gguf.GGMLQuantizationType.F16:
        half = array.astype(np.float16)
        return half, None, half.astype(np.float32)
    data = gguf.quants.quantize(array, kind)
    return data, kind, gguf.quants.dequantize(data, kind).astype(np.float32)


def _weights(rng, vocab: int, with_output: bool) -> list[tuple[str, str, np.ndarray, str]]:
    """(gguf name, HF name, float32 weight in HF layout, ggml type)."""
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    out = [("token_embd.weight", "model.embed_tokens.weight",
            rng.standard_normal((vocab, HIDDEN)), "Q8_0")]
    for i, types in enumerate(_LAYER_TYPES):
        for kind, type_name in types.items():
            out.append((f"blk.{i}.{kind}.weight", f"model.layers.{i}.{_HF_LAYER[kind]}.weight",
                        rng.standard_normal(shapes[kind]) * 0.1, type_name))
        for kind, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            out.append((f"blk.{i}.{kind}.weight", f"model.layers.{i}.{hf}.weight",
                        1 + 0.1 * rng.standard_normal(HIDDEN), "F32"))
    out.append(("output_norm.weight", "model.norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN),
                "F32"))
    if with_output:
        out.append(("output.weight", "lm_head.weight", rng.standard_normal((vocab, HIDDEN)), "Q8_0"))
    return [(g, h, w.astype(np.float32), t) for g, h, w, t in out]


def _add_metadata(writer, tokenizer_dir: Path, rope_scale: float | None) -> int:
    import gguf

    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if rope_scale:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scale)
    return _add_tokenizer(writer, tokenizer_dir)


def _add_tokenizer(writer, tokenizer_dir: Path) -> int:
    """The byte-level BPE of tests/tiny_models.py, as llama.cpp stores a gpt2-style vocabulary."""
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tokenizer_dir)
    model = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in ("<unk>", "<s>", "</s>") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def write_tiny_gguf(path: Path, *, with_output: bool = True, rope_scale: float | None = None,
                    seed: int = 0) -> TinyGGUF:
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    vocab = _add_metadata(writer, path.parent / f"{path.stem}-tokenizer", rope_scale)
    tiny = TinyGGUF(path=path, vocab=vocab)
    for gguf_name, hf_name, weight, type_name in _weights(rng, vocab, with_output):
        stored = weight
        if ".attn_q." in gguf_name:
            stored = permute_like_llama_cpp(weight, HEADS)
        elif ".attn_k." in gguf_name:
            stored = permute_like_llama_cpp(weight, KV_HEADS)
        data, raw_dtype, _ = _stored(stored, type_name)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
        # row quantisation commutes with the row permutation, so this is exact
        tiny.expected[hf_name] = _stored(weight, type_name)[2]
        tiny.types[hf_name] = type_name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tiny
