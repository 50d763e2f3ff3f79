"""LoRA adapters as an attacker with the API key would send them, made from a real adapter's files.

A config whose rank_pattern and alpha_pattern keys backtrack for minutes in Python's re, and the
same with a module name long enough to make that worse; and a process's resident memory, to see
what loads cost and unloads give back.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# a key Python's re takes exponential time on against any name without an x at its end
BACKTRACKING_KEY = "(.*.*)*x"


def with_backtracking_patterns(adapter_dir: Path, out_dir: Path) -> Path:
    """A copy of `adapter_dir` whose config's pattern keys backtrack (they match no module)."""
    shutil.copytree(adapter_dir, out_dir)
    config_path = out_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["rank_pattern"] = {BACKTRACKING_KEY: 4}
    config["alpha_pattern"] = {BACKTRACKING_KEY: 1.0}
    config_path.write_text(json.dumps(config))
    return out_dir


def with_long_module_name(adapter_dir: Path, out_dir: Path, *, dots: int = 300) -> Path:
    """with_backtracking_patterns, one module's pair of tensors renamed to `dots` parts."""
    with_backtracking_patterns(adapter_dir, out_dir)
    weights = out_dir / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    module = next(k for k in tensors if k.endswith(".lora_A.weight")).removesuffix(
        ".lora_A.weight")
    long = "base_model.model.model.layers.0." + "a." * dots + "q_proj"
    for which in ("lora_A", "lora_B"):
        replaced = tensors.pop(f"{module}.{which}.weight")
        tensors[f"{long}.{which}.weight"] = torch.zeros_like(replaced)
    save_file(tensors, str(weights))
    return out_dir


def resident_bytes(pid: int) -> int:
    """VmRSS of process `pid`."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
