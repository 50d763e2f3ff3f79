"""A LoRA adapter directory as the router checks it (the fake shard reads nothing in it)."""
from __future__ import annotations

import json
from pathlib import Path


def make_adapter_dir(root: Path, name: str = "a") -> Path:
    """<root>/<name> with PEFT's two files; the bytes are not read by the router."""
    path = Path(root) / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"not read by the router")
    return path
