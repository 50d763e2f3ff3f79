"""scripts/install.sh's choice of PyTorch build and index, run as a dry run (it prints the pip
command for torch and installs nothing) against a fake nvidia-smi and indexes on loopback."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
H100 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5a0c1f4e-0000-0000-0000-000000000000)"
# what nvidia-smi says on a machine with the tools but no driver or GPU, with its exit status
NO_DRIVER = 'echo "NVIDIA-SMI has failed because it could not communicate with the driver."; exit 9'


@dataclass
class DryRun:
    returncode: int
    said: str  # what the script tells the user
    command: str  # the pip command it would run for torch


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The script and the pins alone: a dry run must leave this folder as it was."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "install.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "constraints.txt", tmp_path)
    return tmp_path


def _torch_pin() -> str:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    return next(line for line in lines if line.startswith("torch=="))


def _dry_run(checkout: Path, nvidia_smi: str, **variables: str) -> DryRun:
    fake = checkout / "fake-bin"
    fake.mkdir(exist_ok=True)
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\n{nvidia_smi}\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TGI_PY_") and not k.lower().endswith("_proxy")}
    env |= {"PATH": f"{fake}:{env['PATH']}", "PYTHON": sys.executable,
            "TGI_PY_INSTALL_DRY_RUN": "1", **variables}
    before = sorted(checkout.rglob("*"))
    done = subprocess.run(["bash", str(checkout / "scripts" / "install.sh")], env=env,
                          capture_output=True, text=True, timeout=30)
    assert sorted(checkout.rglob("*")) == before, "a dry run installs nothing"
    lines = done.stdout.splitlines()
    return DryRun(done.returncode, "\n".join(lines[:-1]) + done.stderr,
                  lines[-1].strip() if lines else "")


@pytest.fixture
def index_url(tmp_path: Path):
    """A package index on loopback with a torch page."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path / "index"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


@pytest.fixture
def silent_url() -> str:
    """An address where nothing listens."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}/"


def test_without_a_gpu_it_takes_the_cpu_build_from_pytorchs_cpu_index_when_it_answers(checkout):
    run = _dry_run(checkout, NO_DRIVER)
    assert run.returncode == 0, run.said
    assert "cpu build (no NVIDIA GPU: nvidia-smi -L lists none)" in run.said
    base = f"pip install --no-deps --force-reinstall {_torch_pin()}"
    if f"{CPU_INDEX} does not answer" in run.said:  # as on a machine that reaches PyPI only
        assert run.command == base
    else:
        assert run.command == f"{base} --index-url {CPU_INDEX}", run.said


def test_with_a_gpu_it_takes_the_cuda_build_from_the_default_index(checkout):
    run = _dry_run(checkout, f"echo '{H100}'")
    assert run.returncode == 0, run.said
    assert "cuda build (nvidia-smi -L lists GPU 0: NVIDIA H100 80GB HBM3)" in run.said
    assert run.command == f"pip install --no-deps --force-reinstall {_torch_pin()}"


def test_the_build_can_be_forced_either_way(checkout, index_url):
    forced_cpu = _dry_run(checkout, f"echo '{H100}'", TGI_PY_TORCH="cpu",
                          TGI_PY_TORCH_INDEX=index_url)
    assert "cpu build (TGI_PY_TORCH=cpu)" in forced_cpu.said
    assert forced_cpu.command.endswith(f"--index-url {index_url}")
    forced_cuda = _dry_run(checkout, NO_DRIVER, TGI_PY_TORCH="cuda")
    assert "cuda build (TGI_PY_TORCH=cuda), from the default index" in forced_cuda.said
    assert "--index-url" not in forced_cuda.command


def test_an_index_that_does_not_answer_falls_back_to_the_default_index(checkout, silent_url):
    run = _dry_run(checkout, f"echo '{H100}'", TGI_PY_TORCH_INDEX=silent_url)
    assert run.returncode == 0, run.said
    assert f"from the default index ({silent_url} does not answer)" in run.said
    assert "--index-url" not in run.command


def test_an_unknown_build_is_refused(checkout):
    run = _dry_run(checkout, NO_DRIVER, TGI_PY_TORCH="rocm")
    assert run.returncode == 2
    assert "TGI_PY_TORCH is cpu or cuda, not 'rocm'" in run.said
