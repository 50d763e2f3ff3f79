"""GGUF (llama.cpp's format) -> a Hugging Face model directory: float32 safetensors, config, tokenizer.

Weights are read with the `gguf` package and dequantised to float32. llama.cpp's converter permutes
the rows of q_proj and k_proj for its rope layout; we undo it so that the rotate-half rope of
Hugging Face's Llama applies.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


class GGUFError(ValueError):
    pass


def hf_tensor_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        if kind not in _LAYER_NAMES:
            raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permutation: interleaved (re, im) pairs back to two halves per head."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
            .swapaxes(1, 2).reshape(weight.shape))


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def llama_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (only llama)")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling and scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling,
                                  "factor": float(_field(reader, "llama.rope.scaling.factor"))}
    return config


def convert_weights(reader, config: dict, out_file: Path) -> None:
    """Every tensor, dequantised to float32 under its Hugging Face name, into one safetensors file."""
    import gguf

    tensors = {}
    for tensor in tqdm(reader.tensors, desc="Converting GGUF weights", unit="tensor"):
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.asarray(array, dtype=np.float32).reshape(
            [int(d) for d in reversed(tensor.shape)])
        if tensor.name.startswith("blk.") and ".attn_q." in tensor.name:
            array = unpermute_rope_rows(array, config["num_attention_heads"])
        elif tensor.name.startswith("blk.") and ".attn_k." in tensor.name:
            array = unpermute_rope_rows(array, config["num_key_value_heads"])
        tensors[hf_tensor_name(tensor.name)] = torch.from_numpy(np.array(array, order="C"))
    save_file(tensors, str(out_file), metadata={"format": "pt"})


def write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template, through transformers' converter."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    if tokenizer.chat_template and not (out_dir / "chat_template.jinja").exists():
        (out_dir / "chat_template.jinja").write_text(tokenizer.chat_template)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Writes the model directory atomically: a half-done conversion never looks complete."""
    import gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    config = llama_config(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        convert_weights(reader, config, staging / "model.safetensors")
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2))
        write_tokenizer(gguf_path, staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir
