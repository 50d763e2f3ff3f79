"""A tiny random Qwen3-MoE written as GGUF the way llama.cpp's converter does.

The experts as stacks [experts, rows, columns] per projection (ffn_gate_exps, ffn_up_exps,
ffn_down_exps), the router as ffn_gate_inp, names from gguf-py's own tensor map. The K-quant
stacks are random blocks (gguf-py has no K-quant quantizer); the transformers model holds what
the `gguf` package dequantizes the file's blocks to, so the test's expectation comes from neither
the converter nor the shard.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.unit.launcher.tiny_arch_gguf import TinyArchGGUF, _stored, _tokenizer

HEADS, KV_HEADS, HEAD_DIM, CONTEXT, TOP_K = 4, 2, 64, 256, 2
# per layer, the ggml types of the gate, up and down stacks: Q4_K_M's (gate and up in one int4
# form), then the other K-quant and legacy types, mixed in one fused projection
EXPERT_TYPES = [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q4_0", "Q8_0")]
_K_FACTORS = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}  # the float16 factors' offsets
_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _random_k_blocks(rng, kind: str, rows: int, columns: int) -> np.ndarray:
    """Random bytes with small finite float16 factors: weights of a few tenths."""
    data = rng.integers(0, 256, (rows, columns // 256 * _BLOCK_BYTES[kind]), dtype=np.uint8)
    blocks = data.reshape(-1, _BLOCK_BYTES[kind])
    for at in _K_FACTORS[kind]:
        factors = (rng.standard_normal(blocks.shape[0]) * 2e-3).astype(np.float16)
        blocks[:, at:at + 2] = factors.view(np.uint8).reshape(-1, 2)
    return data


def _stack(rng, values: np.ndarray, kind: str):
    """(data to write, raw_dtype, the float32 values it dequantizes to) for [E, rows, columns]."""
    import gguf

    if kind not in _K_FACTORS:
        return _stored(values, kind)
    experts, rows, columns = values.shape
    data = _random_k_blocks(rng, kind, experts * rows, columns).reshape(experts, rows, -1)
    quant = gguf.GGMLQuantizationType[kind]
    return data, quant, np.asarray(gguf.quants.dequantize(data, quant), dtype=np.float32)


def _hf_model(vocab: int, *, hidden: int, experts: int, layers: int):
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-6, num_experts=experts, num_experts_per_tok=TOP_K, norm_topk_prob=True,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return transformers.Qwen3MoeForCausalLM(config).eval()


def _metadata(writer, *, hidden: int, experts: int, layers: int) -> None:
    writer.add_block_count(layers)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(TOP_K)
    writer.add_expert_feed_forward_length(hidden)


def _tensors(model, rng):
    """(gguf-py's Hugging Face name, float32 values) in the file's layout: gate and up apart."""
    for name, param in model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):  # transformers 5: [E, 2 * inter, hidden]
            gate, up = param.chunk(2, dim=1)
            base = name.removesuffix("gate_up_proj")
            yield f"{base}gate_proj", gate
            yield f"{base}up_proj", up
            continue
        yield name, param


def write_moe_gguf(path: Path, *, hidden: int = 256, experts: int = 4, layers: int = 2,
                   seed: int = 0) -> TinyArchGGUF:
    """The file at `path`; `expected` holds each GGUF tensor's float32 values by GGUF name."""
    import gguf

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    vocab = _tokenizer(writer, path.parent / f"{path.stem}-tokenizer", "qwen3moe")
    _metadata(writer, hidden=hidden, experts=experts, layers=layers)
    model = _hf_model(vocab, hidden=hidden, experts=experts, layers=layers)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, layers)
    tiny = TinyArchGGUF(path, model)
    state = {}
    for hf_name, param in _tensors(model, rng):
        suffix = ".weight" if hf_name.endswith(".weight") else ""
        base = hf_name.removesuffix(".weight")
        gguf_name = f"{names.get_name(base)}.weight"
        values = rng.standard_normal(param.shape).astype(np.float32)
        kind = gguf_name.split(".")[-2]
        if param.dim() == 1:  # norms around 1
            values, type_name = 1 + 0.1 * values, "F32"
        elif kind == "ffn_gate_inp":  # the router, spread out so that each token has a clear
            values, type_name = 2 * values, "F32"  # choice; llama.cpp keeps it float
        elif param.dim() == 3:
            layer = int(gguf_name.split(".")[1])
            type_name = EXPERT_TYPES[layer % len(EXPERT_TYPES)][
                ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps").index(kind)]
            values = 0.3 * values
        else:
            values, type_name = 0.3 * values, "Q8_0"
        data, raw_dtype, restored = _stack(rng, values.astype(np.float32), type_name)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
        tiny.expected[gguf_name] = restored
        tiny.types[gguf_name] = type_name
        state[base + suffix] = torch.from_numpy(restored)
    for name in list(state):  # back into transformers' fused layout
        if name.endswith("experts.gate_proj"):
            base = name.removesuffix("gate_proj")
            state[f"{base}gate_up_proj"] = torch.cat([state.pop(name),
                                                      state.pop(f"{base}up_proj")], dim=1)
    model.load_state_dict(state, strict=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tiny
