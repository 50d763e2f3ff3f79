"""The runtime environment, printed by `tgi-launcher --env` for bug reports."""
from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

_PACKAGES = ("tgi-py", "torch", "transformers", "tokenizers", "safetensors", "grpcio", "protobuf",
             "aiohttp", "gguf", "opentelemetry-sdk")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> list[str]:
    lines = [f"python: {sys.version.split()[0]} ({sys.executable})",
             f"platform: {platform.platform()} {platform.machine()}",
             f"cpus: {os.cpu_count()}"]
    lines += [f"{name}: {_version(name)}" for name in _PACKAGES]
    try:
        import torch

        cuda = torch.cuda.is_available()
        lines.append(f"cuda: {torch.version.cuda if cuda else 'not available'}")
        if cuda:
            lines += [f"gpu {i}: {torch.cuda.get_device_name(i)}"
                      for i in range(torch.cuda.device_count())]
        lines.append(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}")
    except ImportError:
        lines.append("torch: cannot be imported")
    return lines
