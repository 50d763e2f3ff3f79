"""glibc's allocator settings for the shard process (shard.malloc_tuning)."""
import ctypes.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from shard.config import MALLOC_ENV

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


ROOT = Path(__file__).resolve().parents[3]


def _in_a_fresh_process(env_extra: dict) -> str:
    """What keep_freed_memory answers in a process of its own (the settings are process-wide)."""
    env = {k: v for k, v in os.environ.items()
           if k not in (*MALLOC_ENV, "GLIBC_TUNABLES")}
    code = "from shard.malloc_tuning import keep_freed_memory; print(keep_freed_memory())"
    return subprocess.run([sys.executable, "-c", code], env={**env, **env_extra}, cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(not GLIBC or ctypes.util.find_library("c") is None, reason="glibc only")
def test_glibc_takes_the_settings_unless_they_were_set_by_hand():
    assert _in_a_fresh_process({}) == "True"
    assert _in_a_fresh_process({"MALLOC_MMAP_THRESHOLD_": "65536"}) == "False"
    assert _in_a_fresh_process({"LD_PRELOAD": ""}) == "False"
    assert _in_a_fresh_process({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}) == "False"


@pytest.mark.skipif(not GLIBC or ctypes.util.find_library("c") is None, reason="glibc only")
def test_freed_memory_goes_back_to_the_system_once_asked():
    """Under the raised trim threshold 256 MiB of freed heap blocks stay resident until
    return_freed_memory gives them back."""
    env = {k: v for k, v in os.environ.items()
           if k not in (*MALLOC_ENV, "GLIBC_TUNABLES")}
    code = """
from shard.malloc_tuning import keep_freed_memory, return_freed_memory
def resident():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) // 1024
assert keep_freed_memory()
blocks = [bytearray(1 << 20) for _ in range(256)]  # 1 MiB each: heap blocks, below the mmap threshold
held = resident()
del blocks
kept = resident()
assert return_freed_memory()
print(held, kept, resident())
"""
    held, kept, returned = map(int, subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, check=True, capture_output=True,
        text=True).stdout.split())
    assert kept > held - 32  # freed, but still the process's
    assert returned < kept - 200
