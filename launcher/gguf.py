"""GGUF (llama.cpp's format) -> a Hugging Face Llama directory: float32 safetensors, config, tokenizer.

Weights are read with the `gguf` package and dequantised to float32. llama.cpp's converter permutes
the rows of q_proj and k_proj so that its rope rotates interleaved (even, odd) pairs; we undo it so
that Hugging Face's rotate-half rope applies.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

# Bump when the files written change: directories from an older converter are converted again.
CONVERTER_VERSION = 2
MARKER = ".complete"

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
    if base == "rope_freqs":
        raise GGUFError("this GGUF scales rope with a rope_freqs tensor (Llama 3.1 style), "
                        "which the converter does not support")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        if kind not in _LAYER_NAMES:
            raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permutation: per head, interleaved (re, im) rows back to two halves."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _float32_value(value) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06; keep the short spelling."""
    return float(str(np.float32(value)))


def llama_config(reader) -> dict:
    """config.json for the GGUF's metadata (only the llama architecture)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (only llama)")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // heads))
    if int(_field(reader, "llama.rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError("rope over part of each head is not supported by Hugging Face's Llama")
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32_value(
            _field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float32_value(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 4096)),
        # ggml shapes are reversed: token_embd is [hidden, vocab]
        "vocab_size": shapes["token_embd.weight"][-1],
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    config.update(special_token_ids(reader))
    scaling = rope_scaling(reader)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def special_token_ids(reader) -> dict:
    ids = {"bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
           "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
           "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id")}
    return {name: int(value) for name, value in ids.items() if value is not None}


def rope_scaling(reader) -> dict | None:
    kind = _field(reader, "llama.rope.scaling.type")
    if not kind or kind == "none":
        return None
    scaling = {"rope_type": kind,
               "factor": _float32_value(_field(reader, "llama.rope.scaling.factor", 1.0))}
    original = _field(reader, "llama.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def dequantize_tensor(tensor) -> np.ndarray:
    """float32 in PyTorch's (out_features, in_features) order: ggml's shape reversed."""
    import gguf

    try:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise GGUFError(f"tensor {tensor.name}: cannot dequantise {tensor.tensor_type.name} "
                        f"({err or 'not implemented in the gguf package'})") from None
    shape = [int(d) for d in reversed(tensor.shape)]
    return np.asarray(array, dtype=np.float32).reshape(shape)


def convert_weights(reader, config: dict, out_file: Path, progress=None) -> None:
    """Every tensor, dequantised to float32 under its Hugging Face name, into one safetensors file;
    `progress(bytes read, bytes in all)` of the GGUF's tensor data after each tensor."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm

    tensors = {}
    total, done = sum(int(t.n_bytes) for t in reader.tensors), 0
    for tensor in tqdm(reader.tensors, desc="Converting GGUF weights", unit="tensor",
                       file=sys.stderr):
        name = hf_tensor_name(tensor.name)
        array = dequantize_tensor(tensor)
        if name.endswith("q_proj.weight"):
            array = unpermute_rope_rows(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = unpermute_rope_rows(array, config["num_key_value_heads"])
        # a copy: dequantize may hand back a read-only view of the memory-mapped file
        tensors[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
        done += int(tensor.n_bytes)
        if progress is not None:
            progress(done, total)
    save_file(tensors, str(out_file), metadata={"format": "pt"})


def write_model_files(reader, out_dir: Path, progress=None) -> dict:
    """model.safetensors, config.json and generation_config.json: everything but the tokenizer."""
    config = llama_config(reader)
    convert_weights(reader, config, out_dir / "model.safetensors", progress)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config.get("bos_token_id"),
                  "eos_token_id": config.get("eos_token_id"),
                  "pad_token_id": config.get("pad_token_id")}
    generation = {k: v for k, v in generation.items() if v is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return config


def write_tokenizer(gguf_path: Path, out_dir: Path, *, chat_template: str | None,
                    max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja via transformers' converter."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    # how this one load was made, not a property of the tokenizer
    for key in ("is_local", "local_files_only"):
        tokenizer_config.pop(key, None)
    if chat_template:
        # the GGUF metadata is the source of truth; written to both places tools look in
        (out_dir / "chat_template.jinja").write_text(chat_template)
        tokenizer_config["chat_template"] = chat_template
    config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


def is_converted(out_dir: Path) -> bool:
    """True when `out_dir` holds a finished conversion by this converter version."""
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("converter_version") == CONVERTER_VERSION


def convert_gguf(gguf_path: Path, out_dir: Path, progress=None) -> Path:
    """Converts into a staging directory renamed into place: a half-done run never looks complete.
    `progress(done, total)` follows the weights (bytes of the GGUF's tensor data)."""
    import gguf

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        config = write_model_files(reader, staging, progress)
        write_tokenizer(gguf_path, staging, chat_template=_field(reader, "tokenizer.chat_template"),
                        max_length=config["max_position_embeddings"])
        (staging / MARKER).write_text(json.dumps(
            {"converter_version": CONVERTER_VERSION, "source": str(gguf_path.resolve())}) + "\n")
        _publish(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


def _publish(staging: Path, out_dir: Path) -> None:
    # mkdtemp makes a private 0700 directory; a model cache should read like any download
    staging.chmod(0o755)
    for path in staging.iterdir():
        path.chmod(0o644)
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    # rename() cannot replace a non-empty directory: move the old one aside first
    retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-old-", dir=out_dir.parent))
    os.replace(out_dir, retired / out_dir.name)
    staging.rename(out_dir)
    shutil.rmtree(retired, ignore_errors=True)
