"""The checked-in stubs must be what grpc_tools generates from proto/generate.proto today."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_the_proto(tmp_path):
    (tmp_path / "proto").mkdir()
    shutil.copy(ROOT / "proto" / "generate.proto", tmp_path / "proto")
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.",
                    "--pyi_out=.", "--grpc_python_out=.", "proto/generate.proto"],
                   cwd=tmp_path, check=True)
    for name in ("generate_pb2.py", "generate_pb2.pyi", "generate_pb2_grpc.py"):
        fresh = (tmp_path / "proto" / name).read_text()
        assert fresh == (ROOT / "proto" / name).read_text(), (
            f"proto/{name} is stale: regenerate with scripts/gen-proto.sh")
