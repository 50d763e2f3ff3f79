"""The checked-in stubs must be what grpc_tools generates from the protos today."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("proto", ["generate", "api", "model_host"])
def test_generated_stubs_match_the_proto(tmp_path, proto):
    (tmp_path / "proto").mkdir()
    shutil.copy(ROOT / "proto" / f"{proto}.proto", tmp_path / "proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.",
                    "--pyi_out=.", "--grpc_python_out=.", f"proto/{proto}.proto"],
                   cwd=tmp_path, check=True)
    for name in (f"{proto}_pb2.py", f"{proto}_pb2.pyi", f"{proto}_pb2_grpc.py"):
        fresh = (tmp_path / "proto" / name).read_text()
        assert fresh == (ROOT / "proto" / name).read_text(), (
            f"proto/{name} is stale: regenerate with scripts/gen-proto.sh")
