"""Registry of served architectures: Hugging Face architecture name -> model class and config defaults."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class ArchitectureEntry:
    module: str
    model_class: str
    config_class: str
    config_defaults: dict = field(default_factory=dict)


_LLAMA = ("shard.models.llama", "LlamaForCausalLM", "LlamaConfig")

ARCHITECTURES: dict[str, ArchitectureEntry] = {
    "LlamaForCausalLM": ArchitectureEntry(*_LLAMA),
    "MistralForCausalLM": ArchitectureEntry(*_LLAMA),
    # Qwen2 puts a bias on q/k/v (never on o) and names no attention_bias in its config.
    "Qwen2ForCausalLM": ArchitectureEntry(*_LLAMA, config_defaults={"qkv_bias_default": True}),
    "Qwen3ForCausalLM": ArchitectureEntry("shard.models.qwen3", "Qwen3ForCausalLM", "Qwen3Config"),
    "Qwen3MoeForCausalLM": ArchitectureEntry("shard.models.qwen3_moe", "Qwen3MoeForCausalLM",
                                             "Qwen3MoeConfig"),
    "Gemma2ForCausalLM": ArchitectureEntry("shard.models.gemma", "GemmaForCausalLM", "GemmaConfig",
                                           config_defaults={"generation": 2}),
    "Gemma3ForCausalLM": ArchitectureEntry("shard.models.gemma", "GemmaForCausalLM", "GemmaConfig",
                                           config_defaults={"generation": 3}),
    # Gemma 3's multimodal checkpoints (4B and up): the language model and its vision tower
    "Gemma3ForConditionalGeneration": ArchitectureEntry(
        "shard.models.gemma3_vision", "Gemma3ForConditionalGeneration", "GemmaConfig",
        config_defaults={"generation": 3}),
    # Qwen2.5-VL: Qwen2's language model with multimodal rotary positions, and its vision tower
    "Qwen2_5_VLForConditionalGeneration": ArchitectureEntry(
        "shard.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig"),
    "Phi3ForCausalLM": ArchitectureEntry("shard.models.phi3", "Phi3ForCausalLM", "Phi3Config"),
    # encoders: they embed, and generate nothing
    "BertModel": ArchitectureEntry("shard.models.bert", "BertModel", "BertConfig"),
    "BertForMaskedLM": ArchitectureEntry("shard.models.bert", "BertModel", "BertConfig"),
}


# the architectures that embed and generate nothing (no KV cache: shard/models/bert.py)
ENCODERS = frozenset({"BertModel", "BertForMaskedLM"})


def architecture_of(config: dict) -> str:
    """The first of a config.json's `architectures` served here.

    A ValueError names what is supported. Torch-free: the launcher refuses a model with it before
    any shard starts."""
    names = config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return name
    raise ValueError(f"architecture {names} is not supported; supported: {sorted(ARCHITECTURES)}")


def load_model_class(config: dict):
    """(model class, parsed config) for a config.json, or a ValueError naming what is supported."""
    import importlib

    entry = ARCHITECTURES[architecture_of(config)]
    module = importlib.import_module(entry.module)
    config_class = getattr(module, entry.config_class)
    parsed = config_class.from_dict(config, **entry.config_defaults)
    return getattr(module, entry.model_class), parsed
