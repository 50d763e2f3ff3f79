"""GGUF (llama.cpp's format) -> a Hugging Face model directory: safetensors, config, tokenizer.

Weights are dequantised with the `gguf` package a slice of rows at a time and streamed into
bfloat16 (or, when asked, float32) safetensors shards, so that converting takes about one slice of
memory whatever the model's size. llama.cpp's converter changed some weights on the way in (see
gguf_architectures.py); each slice is changed back before it is written.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launcher import safetensors_stream as st
from launcher.gguf_architectures import (Architecture, GGUFError, Metadata, architecture,
                                         hf_tensor_name, special_token_ids)
from launcher.gguf_file import GGUFFile, TensorInfo, read_gguf
from shard.layers.ggml_types import BLOCKS_KEY, SERVED_TYPES, row_bytes

log = logging.getLogger("tgi.launcher")

# Bump when the files written change: directories from an older converter are converted again.
CONVERTER_VERSION = 3
MARKER = ".complete"
DTYPES = {"bfloat16": "BF16", "float32": "F32"}
# the conversion that keeps each tensor as stored: quantized blocks as bytes the shards serve
# (shard/layers/ggml_quants.py), float tensors in their own dtype
NATIVE = "gguf"
CONVERSIONS = (*DTYPES, NATIVE)
_FLOAT_TYPES = ("F32", "F16", "BF16")
_TRANSFORMERS_LOCK = threading.Lock()  # see write_tokenizer
# Rows are dequantised this many values at a time (4 MB in float32): dequantisation makes a few
# temporaries of this size, and a whole embedding table (a GB in float32) never exists at once.
# Larger slices are no faster, and leave more freed memory that the allocator keeps.
CHUNK_ELEMENTS = 1 << 20


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permutation: per head, interleaved (re, im) rows back to two halves."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@dataclass(frozen=True, slots=True)
class TensorJob:
    """One GGUF tensor, what it is called in Hugging Face's checkpoint and how to restore it."""
    tensor: TensorInfo
    spec: st.TensorSpec
    heads: int = 0  # > 0: undo llama.cpp's rope permutation over this many heads
    offset: float = 0.0  # subtracted from every value (Gemma's norms)
    blocks: str = ""  # the ggml type of a tensor written as its stored blocks
    expert: int | None = None  # one expert's matrix of a stack of experts [experts, rows, columns]

    @property
    def shape(self) -> tuple[int, ...]:
        """The values this job writes: the tensor's, or one expert's of a stack."""
        return self.tensor.shape if self.expert is None else self.tensor.shape[1:]

    @property
    def columns(self) -> int:
        return self.tensor.shape[-1]

    @property
    def rows(self) -> int:
        return self.shape[0] if len(self.shape) >= 2 else 1

    @property
    def first_row(self) -> int:
        """Where the job's rows start among the tensor's rows (of every expert, in order)."""
        return 0 if self.expert is None else self.expert * self.rows

    @property
    def rows_per_chunk(self) -> int:
        shape = self.shape
        if len(shape) < 2:
            return 1
        row = math.prod(shape[1:])
        # the permutation is within each head: slices hold whole heads
        step = shape[0] // self.heads if self.heads else 1
        return max(step, CHUNK_ELEMENTS // row // step * step)


def plan_tensors(model: GGUFFile, arch: Architecture, config: dict, dtype: str) -> list[TensorJob]:
    jobs = []
    for tensor in model.tensors:
        name = hf_tensor_name(tensor.name, arch)
        heads = 0
        if arch.permute_qk and name.endswith("q_proj.weight"):
            heads = config["num_attention_heads"]
        elif arch.permute_qk and name.endswith("k_proj.weight"):
            heads = config["num_key_value_heads"]
        offset = arch.norm_offset if name.endswith("norm.weight") else 0.0
        native = None  # how the tensor is written natively: each expert as the first (one log)
        for expert in _experts(name, tensor, config):
            own = name if expert is None else name.format(expert=expert)
            shape = tensor.shape if expert is None else tensor.shape[1:]
            if dtype != NATIVE:
                spec, blocks = st.TensorSpec(own, shape, DTYPES[dtype]), ""
            else:
                native = native or _native_spec(own, tensor, offset, shape)
                spec, blocks = st.TensorSpec(own, native[0].shape, native[0].dtype), native[1]
            jobs.append(TensorJob(tensor, spec, heads, offset, blocks, expert))
    return jobs


def _experts(name: str, tensor: TensorInfo, config: dict) -> list[int | None]:
    """The experts a stack of them [experts, rows, columns] is written as, one matrix each.

    [None] for any other tensor. Each expert's matrix is served as the dense layers' are."""
    if "{expert}" not in name:
        return [None]
    if len(tensor.shape) != 3 or tensor.shape[0] != config["num_experts"]:
        raise GGUFError(f"tensor {tensor.name} is {list(tensor.shape)}, not a stack of the "
                        f"{config['num_experts']} experts the GGUF's expert_count names "
                        "[experts, rows, columns]")
    return list(range(tensor.shape[0]))


def _native_spec(name: str, tensor: TensorInfo, offset: float,
                 shape: tuple[int, ...] | None = None) -> tuple[st.TensorSpec, str]:
    """How the native conversion writes a tensor: (its spec, its ggml type where kept as blocks).

    `shape`: the values written (one expert's of a stack; None: the tensor's). A matrix of a
    served type stays its blocks ([rows, row bytes] of U8); a float tensor keeps its dtype
    (float32 where an offset is taken off it); anything else (another type) is dequantized to
    bfloat16, as the bf16 conversion writes it, which the log says."""
    import gguf

    shape = tensor.shape if shape is None else shape
    kind = gguf.GGMLQuantizationType(tensor.ggml_type).name
    if kind in SERVED_TYPES and len(shape) == 2:
        return st.TensorSpec(name, (shape[0], row_bytes(kind, shape[1])), "U8"), kind
    if kind in _FLOAT_TYPES:
        return st.TensorSpec(name, shape, "F32" if offset else kind), ""
    why = f"a {len(shape)}-D tensor is not" if kind in SERVED_TYPES else f"{kind} is not"
    log.info("tensor %s: %s served as stored (served: matrices of %s); dequantized to bfloat16",
             tensor.name, why, ", ".join(SERVED_TYPES))
    return st.TensorSpec(name, shape, "BF16"), ""


def read_rows(file, job: TensorJob, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of a tensor as stored (values, or ggml's blocks as bytes).

    Read from the file rather than through a memory map: mapped pages count in the process's
    resident memory until the kernel takes them back, so a map read end to end looks like the whole
    model held."""
    import gguf

    tensor, shape = job.tensor, job.shape
    # bytes a row takes: the tensor's bytes over its rows (of every expert, in a stack)
    stride = tensor.nbytes // (job.rows * (1 if job.expert is None else tensor.shape[0]))
    buffer = np.empty((stop - start) * stride, dtype=np.uint8)
    file.seek(tensor.offset + (job.first_row + start) * stride)
    view, filled = memoryview(buffer), 0
    while filled < buffer.nbytes:  # a raw read may return less than asked
        got = file.readinto(view[filled:])
        if not got:
            raise GGUFError(f"tensor {tensor.name}: the file ends inside its data")
        filled += got
    rows_shape = (stop - start, *shape[1:]) if len(shape) >= 2 else shape
    kind = gguf.GGMLQuantizationType(tensor.ggml_type)
    if kind == gguf.GGMLQuantizationType.F32:
        return buffer.view(np.float32).reshape(rows_shape)
    if kind == gguf.GGMLQuantizationType.F16:
        return buffer.view(np.float16).reshape(rows_shape)
    return buffer.reshape(gguf.quants.quant_shape_to_byte_shape(rows_shape, kind))


def dequantize_rows(tensor: TensorInfo, stored: np.ndarray) -> np.ndarray:
    import gguf

    kind = gguf.GGMLQuantizationType(tensor.ggml_type)
    try:
        return np.asarray(gguf.quants.dequantize(stored, kind), dtype=np.float32)
    except NotImplementedError as err:
        raise GGUFError(f"tensor {tensor.name}: cannot dequantise {kind.name} "
                        f"({err or 'not implemented in the gguf package'})") from None


def tensor_bytes(file, job: TensorJob, progress) -> Iterator[memoryview]:
    """The tensor in Hugging Face's layout and the target dtype, a slice of rows at a time.

    `progress(GGUF bytes)` is called after each slice."""
    import torch

    rows, step = job.rows, job.rows_per_chunk
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        stored = read_rows(file, job, start, stop)
        if job.blocks:  # the blocks as they are: rows of bytes, permuted like values
            values = stored.reshape(stop - start, -1)
        elif job.spec.dtype == "F16" and stored.dtype == np.float16:
            values = stored
        else:
            values = dequantize_rows(job.tensor, stored)
        if job.heads:
            values = unpermute_rope_rows(values, (stop - start) * job.heads // rows)
        if job.offset:
            values = values - np.float32(job.offset)
        if job.blocks:
            yield memoryview(np.ascontiguousarray(values)).cast("B")
        elif job.spec.dtype == "F16":
            yield memoryview(np.ascontiguousarray(values, dtype="<f2")).cast("B")
        elif job.spec.dtype == "BF16":
            # torch rounds to nearest even; numpy has no bfloat16
            values = torch.from_numpy(np.require(values, requirements=["C", "W"]))
            yield memoryview(values.to(torch.bfloat16).view(torch.int16).numpy()).cast("B")
        else:
            yield memoryview(np.ascontiguousarray(values, dtype="<f4")).cast("B")
        progress(stored.nbytes)


def convert_weights(model: GGUFFile, arch: Architecture, config: dict, out_dir: Path,
                    dtype: str, progress=None) -> None:
    """Every tensor under its Hugging Face name, written into safetensors shards.

    With their index when there are several; `progress(bytes read, bytes in all)` of the GGUF's
    tensor data."""
    from tqdm import tqdm

    jobs = plan_tensors(model, arch, config, dtype)
    by_name = {job.spec.name: job for job in jobs}
    shards = st.plan_shards([job.spec for job in jobs], st.MAX_SHARD_BYTES)
    names = st.shard_file_names(len(shards))
    total, done = sum(t.nbytes for t in model.tensors), 0

    def advance(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    bar = tqdm(total=len(jobs), desc="Converting GGUF weights", unit="tensor", file=sys.stderr)
    with open(model.path, "rb", buffering=0) as file, bar:
        for shard, name in zip(shards, names):
            def chunks(shard=shard):
                for spec in shard:
                    yield tensor_bytes(file, by_name[spec.name], advance)
                    bar.update()

            blocks = {spec.name: [by_name[spec.name].blocks, by_name[spec.name].columns]
                      for spec in shard if by_name[spec.name].blocks}
            metadata = {"format": "pt"} | ({BLOCKS_KEY: json.dumps(blocks)} if blocks else {})
            st.write_shard(out_dir / name, shard, chunks(), metadata=metadata)
    if len(shards) > 1:
        st.write_index(out_dir, shards, names)


def write_model_files(model: GGUFFile | Path, out_dir: Path, progress=None, *,
                      dtype: str = "bfloat16") -> dict:
    """The weights, config.json and generation_config.json: everything but the tokenizer."""
    model = model if isinstance(model, GGUFFile) else read_gguf(model)
    meta = Metadata.of(model)
    arch = architecture(meta)
    config = arch.config(meta) | special_token_ids(meta) | {"torch_dtype": _check_dtype(dtype)}
    if dtype == NATIVE:
        # what the shards compute in by default; the blocks' types are said beside it
        config |= {"torch_dtype": "bfloat16",
                   "quantization_config": native_quantization(model, arch, config)}
    convert_weights(model, arch, config, out_dir, dtype, progress)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                  if key in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return config


def write_tokenizer(gguf_path: Path, out_dir: Path, *, chat_template: str | None,
                    max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja via transformers' converter."""
    # one at a time: two pulls importing transformers' lazy modules at once (the model host
    # converts in a thread per pull) failed with "cannot import name 'AutoTokenizer'"
    with _TRANSFORMERS_LOCK:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent),
                                                  gguf_file=gguf_path.name)
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    # how this one load was made, not a property of the tokenizer
    for key in ("is_local", "local_files_only"):
        tokenizer_config.pop(key, None)
    if chat_template:
        # the GGUF metadata is the source of truth; written to both places tools look in
        (out_dir / "chat_template.jinja").write_text(chat_template)
        tokenizer_config["chat_template"] = chat_template
    config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


def quantization_name(gguf_path: Path) -> str:
    """llama.cpp's name for how the file is quantised ("Q4_K_M", "Q4_1"), "" when it does not say.

    Reads the header alone (gguf-py's reader would parse the whole vocabulary into objects)."""
    return file_type_name(read_gguf(gguf_path))


def native_quantization(model: GGUFFile, arch: Architecture, config: dict) -> dict:
    """config.json's quantization_config of a native conversion: the file's types, as served.

    `tensor_types`: how many matrices of each ggml type are served as stored; `dequantized`:
    those of types served as float32."""
    import gguf

    served: dict[str, int] = {}
    dequantized: dict[str, int] = {}
    for job in plan_tensors(model, arch, config, NATIVE):
        kind = gguf.GGMLQuantizationType(job.tensor.ggml_type).name
        if job.blocks:
            served[kind] = served.get(kind, 0) + 1
        elif kind not in _FLOAT_TYPES:
            dequantized[kind] = dequantized.get(kind, 0) + 1
    return {"quant_method": NATIVE, "file_type": file_type_name(model),
            "tensor_types": dict(sorted(served.items())),
            "dequantized": dict(sorted(dequantized.items()))}


def file_type_name(model: GGUFFile) -> str:
    """llama.cpp's name for how a file is quantised ("Q4_K_M", "Q4_1"), "" when it does not say."""
    import gguf

    file_type = model.metadata.get("general.file_type")
    if file_type is None:
        return ""
    try:
        return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except ValueError:
        return str(file_type)


def _check_dtype(dtype: str) -> str:
    if dtype not in CONVERSIONS:
        raise ValueError(f"GGUF conversion writes {', '.join(CONVERSIONS)}, not {dtype!r}")
    return dtype


def is_converted(out_dir: Path, dtype: str = "bfloat16") -> bool:
    """True when `out_dir` holds a finished conversion by this converter version into `dtype`."""
    _check_dtype(dtype)
    try:
        marker = json.loads((Path(out_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(marker, dict) and marker.get("converter_version") == CONVERTER_VERSION
            and marker.get("dtype") == dtype)


def convert_gguf(gguf_path: Path, out_dir: Path, progress=None, *,
                 dtype: str = "bfloat16") -> Path:
    """A GGUF converted into a model directory at `out_dir`, which it returns.

    Converts into a staging directory renamed into place: a half-done run never looks complete.
    `progress(done, total)` follows the weights (bytes of the GGUF's tensor data)."""
    _check_dtype(dtype)
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    model = read_gguf(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        config = write_model_files(model, staging, progress, dtype=dtype)
        write_tokenizer(gguf_path, staging,
                        chat_template=model.metadata.get("tokenizer.chat_template"),
                        max_length=config["max_position_embeddings"])
        (staging / MARKER).write_text(json.dumps(
            {"converter_version": CONVERTER_VERSION, "dtype": dtype,
             "source": str(gguf_path.resolve())}) + "\n")
        _publish(staging, out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


def _publish(staging: Path, out_dir: Path) -> None:
    # mkdtemp makes a private 0700 directory; a model cache should read like any download
    staging.chmod(0o755)
    for path in staging.iterdir():
        path.chmod(0o644)
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    # rename() cannot replace a non-empty directory: move the old one aside first
    retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-old-", dir=out_dir.parent))
    os.replace(out_dir, retired / out_dir.name)
    staging.rename(out_dir)
    shutil.rmtree(retired, ignore_errors=True)
