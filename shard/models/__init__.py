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
}


def load_model_class(config: dict):
    """(model class, parsed config) for a config.json, or a ValueError naming what is supported."""
    import importlib

    names = config.get("architectures") or []
    for name in names:
        entry = ARCHITECTURES.get(name)
        if entry is not None:
            module = importlib.import_module(entry.module)
            config_class = getattr(module, entry.config_class)
            parsed = config_class.from_dict(config, **entry.config_defaults)
            return getattr(module, entry.model_class), parsed
    raise ValueError(f"architecture {names} is not supported; supported: {sorted(ARCHITECTURES)}")
