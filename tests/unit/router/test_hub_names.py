"""Jan's and Cortex's names of Hub models read as a repository and a file (hub_names)."""
import pytest

from router.errors import ValidationError
from router.lifecycle.hub_names import HubName, hub_name, pick_gguf
from router.lifecycle.local_paths import is_path_like

REPO = "bartowski/Llama-3.2-1B-Instruct-GGUF"


@pytest.mark.parametrize("source, expected, model_id", [
    (f"https://huggingface.co/{REPO}", HubName(REPO), REPO),
    (f"https://huggingface.co/{REPO}/", HubName(REPO), REPO),
    (f"https://huggingface.co/{REPO}/tree/v2", HubName(REPO, revision="v2"), REPO),
    (f"https://huggingface.co/{REPO}/resolve/main/Llama-3.2-1B-Instruct-Q4_K_M.gguf",
     HubName(REPO, "main", "Llama-3.2-1B-Instruct-Q4_K_M.gguf"), "Llama-3.2-1B-Instruct-Q4_K_M"),
    (f"https://huggingface.co/{REPO}/blob/main/sub/x.gguf?download=true",
     HubName(REPO, "main", "sub/x.gguf"), "x"),
    (f"https://hf.co/{REPO}/resolve/main/config.json", HubName(REPO, revision="main"), REPO),
    (f"{REPO}:Q4_K_M", HubName(REPO, quant="Q4_K_M"), f"{REPO}-Q4_K_M"),
    ("llama3.2:3b-gguf-q4-km", HubName("cortexso/llama3.2", revision="3b-gguf-q4-km",
                                       one_gguf=True), "llama3.2-3b-gguf-q4-km"),
])
def test_hub_names_resolve_to_their_repository_and_file(source, expected, model_id):
    name = hub_name(source)
    assert name == expected and name.model_id == model_id
    assert not is_path_like(source), "never a local path"


@pytest.mark.parametrize("source", [REPO, "gemma3-270m", "/models/x.gguf", "./x", "x.gguf"])
def test_plain_ids_paths_and_short_names_are_no_hub_names(source):
    assert hub_name(source) is None


HUB = f"https://huggingface.co/{REPO}"


@pytest.mark.parametrize("source", ["https://example.com/a/b", "https://huggingface.co/a",
                                    "https://[", f"{HUB}/commits/main",
                                    f"{HUB}/resolve/main/../x.gguf",
                                    # `..` quoted: once a file path and a revision of `..`
                                    f"{HUB}/resolve/main/a%2F..%2F..%2Fx.gguf",
                                    f"{HUB}/resolve/%2E%2E/x.gguf", f"{HUB}/tree/..%2F.."])
def test_unreadable_hub_urls_are_refused(source):
    with pytest.raises(ValidationError):
        hub_name(source)


def test_source_urls():
    assert hub_name(f"{REPO}:Q8_0").url == f"https://huggingface.co/{REPO}"
    url = f"https://huggingface.co/{REPO}/resolve/main/a.gguf"
    assert hub_name(url.replace("resolve", "blob")).url == url


FILES = ["README.md", "Llama-Q4_K.gguf", "Llama-Q4_K_M.gguf", "Llama-Q8_0.gguf",
         "split/Llama-Q6_K-00001-of-00002.gguf", "split/Llama-Q6_K-00002-of-00002.gguf"]


def test_a_quantization_picks_its_one_gguf_file():
    assert pick_gguf(FILES, HubName(REPO, quant="Q4_K")) == "Llama-Q4_K.gguf"
    assert pick_gguf(FILES, HubName(REPO, quant="q4_k_m")) == "Llama-Q4_K_M.gguf"
    with pytest.raises(ValueError, match="has no GGUF file of quantization IQ2_XS"):
        pick_gguf(FILES, HubName(REPO, quant="IQ2_XS"))
    with pytest.raises(ValueError, match="has 2 GGUF files"):
        pick_gguf(FILES, HubName(REPO, quant="Q6_K"))
    assert pick_gguf(["model.gguf", "model.yml"], HubName("cortexso/x", "1b", one_gguf=True)) \
        == "model.gguf"
