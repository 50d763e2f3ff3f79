"""What differs between the architectures a GGUF can hold.

Tensor names, what llama.cpp's converter did to the weights, and the config.json transformers
needs for the same model.

transformers' own GGUF loader (modeling_gguf_pytorch_utils.py) is the reference for the weights:
only llama's q/k rows are permuted, and every Gemma norm is stored as 1 + weight (Hugging Face's
Gemma RMSNorm multiplies by 1 + weight, llama.cpp's by the weight itself).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


class GGUFError(ValueError):
    pass


_PROJECTIONS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LLAMA_LAYER = _PROJECTIONS | {"attn_norm": "input_layernorm",
                               "ffn_norm": "post_attention_layernorm"}
# Gemma normalises around both blocks: ffn_norm is the norm before the MLP, not after attention
_GEMMA2_LAYER = _PROJECTIONS | {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Qwen3-MoE's router and its stacks of experts ([experts, rows, columns]), written one matrix per
# expert under the Hub's names ({expert} is filled in per expert)
_EXPERT_LAYER = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
                 "ffn_up_exps": "mlp.experts.{expert}.up_proj",
                 "ffn_down_exps": "mlp.experts.{expert}.down_proj"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


def float32_value(value) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06; keep the short spelling."""
    return float(str(np.float32(value)))


@dataclass(frozen=True, slots=True)
class Metadata:
    """The GGUF's key-values under its architecture's prefix, and its tensor shapes."""
    values: dict
    arch: str
    shapes: dict[str, tuple[int, ...]]  # GGUF name -> PyTorch order (ggml's reversed)

    @classmethod
    def of(cls, gguf_file) -> Metadata:
        return cls(gguf_file.metadata, gguf_file.architecture,
                   {t.name: t.shape for t in gguf_file.tensors})

    def get(self, key: str, default=None):
        return self.values.get(f"{self.arch}.{key}", default)

    def general(self, key: str, default=None):
        return self.values.get(key, default)

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise GGUFError(f"the GGUF lacks {self.arch}.{key}")
        if isinstance(value, list):  # per layer (some exports): only a uniform value fits HF
            if len(set(value)) != 1:
                raise GGUFError(f"{self.arch}.{key} differs between layers ({value}), which "
                                "Hugging Face's configuration cannot express")
            value = value[0]
        return int(value)

    def float(self, key: str, default: float) -> float:
        return float32_value(self.get(key, default))


@dataclass(frozen=True, slots=True)
class Architecture:
    layer_names: dict[str, str]
    config: Callable[[Metadata], dict]
    # llama.cpp interleaved q/k rows per head for its rope (llama only)
    permute_qk: bool = False
    # llama.cpp stored every norm weight plus this (Gemma: 1)
    norm_offset: float = 0.0


def hf_tensor_name(gguf_name: str, arch: Architecture) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base == "rope_freqs":
        raise GGUFError("this GGUF scales rope with a rope_freqs tensor (Llama 3.1 style), "
                        "which the converter does not support")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        if kind not in arch.layer_names:
            raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{arch.layer_names[kind]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _common(meta: Metadata, eps_default: float) -> dict:
    heads = meta.int("attention.head_count")
    hidden = meta.int("embedding_length")
    head_dim = meta.int("attention.key_length", hidden // heads)
    if meta.int("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError("rope over part of each head is not supported by Hugging Face's "
                        f"{meta.arch} models")
    if "token_embd.weight" not in meta.shapes:
        raise GGUFError("the GGUF has no token_embd.weight")
    return {
        "hidden_size": hidden,
        "intermediate_size": meta.int("feed_forward_length"),
        "num_hidden_layers": meta.int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.int("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta.float("attention.layer_norm_rms_epsilon", eps_default),
        "max_position_embeddings": meta.int("context_length", 4096),
        "vocab_size": meta.shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in meta.shapes,
    }


def rope_scaling(meta: Metadata) -> dict | None:
    kind = meta.get("rope.scaling.type")
    if not kind or kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": meta.float("rope.scaling.factor", 1.0)}
    original = meta.get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _with_rope(config: dict, meta: Metadata, theta_default: float) -> dict:
    config["rope_theta"] = meta.float("rope.freq_base", theta_default)
    scaling = rope_scaling(meta)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def llama_config(meta: Metadata) -> dict:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              **_common(meta, 1e-5), "attention_bias": False, "mlp_bias": False,
              "hidden_act": "silu"}
    return _with_rope(config, meta, 10000.0)


def qwen2_config(meta: Metadata) -> dict:
    # q/k/v biases are part of Qwen2's architecture, not a config switch
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_common(meta, 1e-6),
              "hidden_act": "silu", "use_sliding_window": False}
    return _with_rope(config, meta, 1000000.0)


def qwen3_config(meta: Metadata) -> dict:
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **_common(meta, 1e-6),
              "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}
    return _with_rope(config, meta, 1000000.0)


def qwen3moe_config(meta: Metadata) -> dict:
    """Qwen3-MoE as llama.cpp runs it: every layer sparse, the top-k weights renormalised.

    llama.cpp's qwen3moe graph always renormalises (transformers' GGUF loader sets
    norm_topk_prob for it too); the GGUF does not store the flag."""
    config = qwen3_config(meta) | {"architectures": ["Qwen3MoeForCausalLM"],
                                   "model_type": "qwen3_moe"}
    config.update({"num_experts": meta.int("expert_count"),
                   "num_experts_per_tok": meta.int("expert_used_count"),
                   "moe_intermediate_size": meta.int("expert_feed_forward_length"),
                   "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []})
    return config


def _query_pre_attn_scalar(config: dict, big_layer_count: int) -> int:
    """Gemma's query_pre_attn_scalar as llama.cpp applies it; the GGUF does not store it.

    llama.cpp scales queries by 1/sqrt(hidden / heads) for the 27B Gemma (which it recognises by its
    layer count) and by 1/sqrt(head_dim) otherwise."""
    if config["num_hidden_layers"] == big_layer_count:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _layer_types(meta: Metadata, layers: int, default_period: int) -> list[str]:
    """Each layer's attention: full or a sliding window (llama.cpp's swa pattern).

    Every `period`-th layer attends to everything, the others to a sliding window, or per layer from
    the GGUF when it lists them (true: sliding)."""
    pattern = meta.get("attention.sliding_window_pattern", default_period)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{meta.arch}.attention.sliding_window_pattern lists {len(pattern)} "
                            f"layers, the model has {layers}")
        return ["sliding_attention" if sliding else "full_attention" for sliding in pattern]
    period = int(pattern)
    return ["sliding_attention" if period and (i + 1) % period else "full_attention"
            for i in range(layers)]


def _gemma_common(meta: Metadata) -> dict:
    config = _common(meta, 1e-6)
    config.update({"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                   "sliding_window": meta.int("attention.sliding_window")})
    return config


def _softcap(meta: Metadata, key: str) -> float | None:
    value = meta.get(key)
    return None if value is None else float32_value(value)


def gemma2_config(meta: Metadata) -> dict:
    config = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
              **_gemma_common(meta)}
    config.update({
        "query_pre_attn_scalar": _query_pre_attn_scalar(config, big_layer_count=46),
        "layer_types": _layer_types(meta, config["num_hidden_layers"], 2),
        "attn_logit_softcapping": _softcap(meta, "attn_logit_softcapping"),
        "final_logit_softcapping": _softcap(meta, "final_logit_softcapping"),
    })
    return _with_rope(config, meta, 10000.0)


def gemma3_config(meta: Metadata) -> dict:
    """Gemma 3's text model config as its Hub checkpoints spell it.

    rope_theta for the full-attention layers, rope_local_base_freq for the sliding ones, a
    rope_scaling that applies to the full ones only: transformers turns these into its
    per-layer-type rope_parameters."""
    config = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              **_gemma_common(meta)}
    config.update({
        "query_pre_attn_scalar": _query_pre_attn_scalar(config, big_layer_count=62),
        "layer_types": _layer_types(meta, config["num_hidden_layers"], 6),
        "attn_logit_softcapping": _softcap(meta, "attn_logit_softcapping"),
        "final_logit_softcapping": _softcap(meta, "final_logit_softcapping"),
        "rope_local_base_freq": meta.float("rope.freq_base_swa", 10000.0),
        "rope_scaling": None,
    })
    return _with_rope(config, meta, 1000000.0)


ARCHITECTURES = {
    "llama": Architecture(_LLAMA_LAYER, llama_config, permute_qk=True),
    "qwen2": Architecture(_LLAMA_LAYER, qwen2_config),
    "qwen3": Architecture(_LLAMA_LAYER | _QK_NORMS, qwen3_config),
    "qwen3moe": Architecture(_LLAMA_LAYER | _QK_NORMS | _EXPERT_LAYER, qwen3moe_config),
    "gemma2": Architecture(_GEMMA2_LAYER, gemma2_config, norm_offset=1.0),
    "gemma3": Architecture(_GEMMA2_LAYER | _QK_NORMS, gemma3_config, norm_offset=1.0),
}


def architecture(meta: Metadata) -> Architecture:
    if meta.arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {meta.arch!r} is not supported (only "
                        f"{', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[meta.arch]


def special_token_ids(meta: Metadata) -> dict:
    ids = {"bos_token_id": meta.general("tokenizer.ggml.bos_token_id"),
           "eos_token_id": meta.general("tokenizer.ggml.eos_token_id"),
           "pad_token_id": meta.general("tokenizer.ggml.padding_token_id")}
    ids = {name: int(value) for name, value in ids.items() if value is not None}
    turn_end = _gemma_turn_end(meta)
    if turn_end is not None and turn_end != ids.get("eos_token_id"):
        ids["eos_token_id"] = [ids["eos_token_id"], turn_end] if "eos_token_id" in ids \
            else turn_end
    return ids


def _gemma_turn_end(meta: Metadata) -> int | None:
    """The id of <end_of_turn>, where a Gemma chat model's generation must stop too.

    A Gemma chat model ends its turn with <end_of_turn>, not <eos>: with a chat template that writes
    it, generation must stop there too (a base model has no template and keeps <eos>)."""
    template = meta.general("tokenizer.chat_template") or ""
    if not meta.arch.startswith("gemma") or "<end_of_turn>" not in template:
        return None
    tokens = meta.general("tokenizer.ggml.tokens") or []
    return tokens.index("<end_of_turn>") if "<end_of_turn>" in tokens else None
