"""The launcher process supervises: what it imports stays small."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_launcher_does_not_hold_pytorch():
    """PyTorch (about 200 MB resident, a second to import) belongs to the shards; the launcher
    imports it only to convert a file."""
    probe = "import sys, launcher.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"
