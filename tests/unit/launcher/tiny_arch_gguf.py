"""Tiny random Gemma 2/3 and Qwen 2/3 models written as GGUF the way llama.cpp's converter does:
names from gguf-py's own tensor map, Gemma's norms stored as 1 + weight, mixed tensor types.

The converter is checked against the model these files were made from, so what the test expects
does not come from the code under test (nor from transformers' GGUF loader, which derives a
different query scale for such a small Gemma)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tests.tiny_models import build_tokenizer

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, CONTEXT, WINDOW = 64, 128, 4, 2, 32, 256, 4
TURN_END = "<end_of_turn>"
GEMMA_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
                  "{% endif %}")
# per tensor kind, the ggml type llama.cpp might pick (norms and biases always stay F32)
_TYPES = {"token_embd": "Q8_0", "output": "Q8_0", "attn_q": "Q8_0", "attn_k": "F16",
          "attn_v": "Q4_1", "attn_output": "F32", "ffn_gate": "F16", "ffn_up": "Q8_0",
          "ffn_down": "Q5_0"}


@dataclass
class TinyArchGGUF:
    path: Path
    model: torch.nn.Module  # the transformers model, its weights replaced by what the file holds
    # Hugging Face name -> the float32 values a correct conversion must produce
    expected: dict[str, np.ndarray] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)


def _hf_model(arch: str, vocab: int, layers: int):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN,
                  num_hidden_layers=layers, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=CONTEXT,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gemma3":
        config = transformers.Gemma3TextConfig(
            head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
            rope_theta=1000000.0, rope_local_base_freq=10000.0, **common)
        return transformers.Gemma3ForCausalLM(config)
    if arch == "gemma2":
        config = transformers.Gemma2Config(
            head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW,
            attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0,
            **common)
        return transformers.Gemma2ForCausalLM(config)
    if arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=HEAD_DIM, rope_theta=1000000.0,
                                          tie_word_embeddings=False, **common)
        return transformers.Qwen3ForCausalLM(config)
    if arch == "qwen2":
        config = transformers.Qwen2Config(rope_theta=1000000.0, tie_word_embeddings=True,
                                          **common)
        return transformers.Qwen2ForCausalLM(config)
    raise ValueError(arch)


def _metadata(writer, arch: str, layers: int, with_template: bool) -> None:
    writer.add_block_count(layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0 if arch == "gemma2" else 1000000.0)
    if arch != "qwen2":
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    if arch.startswith("gemma"):
        writer.add_sliding_window(WINDOW)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    if with_template:
        writer.add_chat_template(GEMMA_TEMPLATE)


def _tokenizer(writer, tokenizer_dir: Path, arch: str) -> int:
    """The byte-level BPE of tests/tiny_models.py (Gemma's own is sentencepiece; the converter
    hands either to transformers alike), with Gemma's end-of-turn token appended."""
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tokenizer_dir)
    model = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    if arch.startswith("gemma"):
        tokens.append(TURN_END)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in ("<unk>", "<s>", "</s>", TURN_END) else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    return len(tokens)


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


def write_arch_gguf(path: Path, arch: str, *, layers: int = 6, with_template: bool = True,
                    seed: int = 0) -> TinyArchGGUF:
    import gguf

    torch.manual_seed(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    vocab = _tokenizer(writer, path.parent / f"{path.stem}-tokenizer", arch)
    _metadata(writer, arch, layers, with_template and arch.startswith("gemma"))
    model = _hf_model(arch, vocab, layers).eval()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    gemma = arch.startswith("gemma")
    tiny = TinyArchGGUF(path, model)
    state = {}
    for hf_name, param in model.state_dict().items():
        if hf_name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        # random weights everywhere (norms around 1 in effect, biases non-zero)
        weight = torch.randn(param.shape) * (0.1 if param.dim() == 1 else 0.5)
        if param.dim() == 1 and not gemma:
            weight += 1
        weight = weight.numpy().astype(np.float32)
        kind = gguf_name.split(".")[-2]
        type_name = _TYPES.get(kind, "F32") if param.dim() == 2 else "F32"
        is_norm = hf_name.endswith("norm.weight")
        stored = weight + np.float32(1) if gemma and is_norm else weight
        data, raw_dtype, restored = _stored(stored, type_name)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
        tiny.expected[hf_name] = restored - np.float32(1) if gemma and is_norm else restored
        tiny.types[hf_name] = type_name
        state[hf_name] = torch.from_numpy(tiny.expected[hf_name])
    model.load_state_dict(state, strict=False)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tiny
