"""GGUF -> safetensors conversion at real size: peak resident memory, time and output size.

Builds a synthetic Llama GGUF of about the size asked (random weights, Q4_K_M-like types by default:
Q4_K matrices, Q6_K for ffn_down and attn_v, F32 norms; or all F16), then converts it in a fresh
process that reports its resident memory before (interpreter, torch, gguf imported) and at its peak.

    python benchmarks/gguf_convert.py --size-gb 3 --work-dir /tmp/gguf-bench
    python benchmarks/gguf_convert.py --gguf model.gguf --dtype float32
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# where each block type keeps its float16 scales (d, dmin): random bytes elsewhere are valid
# quants, random bytes there could be inf or NaN
_SCALE_OFFSETS = {"Q8_0": (0,), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
TYPE_MIXES = {
    "q4_k_m": {"default": "Q4_K", "ffn_down": "Q6_K", "attn_v": "Q6_K", "token_embd": "Q6_K",
               "output": "Q6_K"},
    "f16": {"default": "F16"},
    "mixed": {"default": "F32", "token_embd": "F32", "output": "F16", "attn_q": "Q8_0",
              "attn_k": "Q5_0", "attn_v": "Q6_K", "ffn_gate": "Q4_K", "ffn_up": "F16",
              "ffn_down": "Q8_0"},
}


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    heads: int = 16
    kv_heads: int = 4
    ffn: int = 5632
    vocab: int = 32000
    layers: int = 22

    @classmethod
    def of_width(cls, hidden: int, vocab: int) -> Shape:
        """TinyLlama's proportions (128-wide heads, 4 queries per KV head, FFN 2.75x) at a width."""
        heads = max(1, hidden // 128)
        return cls(hidden, heads, max(1, heads // 4), -(-hidden * 11 // 4 // 256) * 256, vocab)

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, PyTorch-order shape), in llama.cpp's order."""
        head_dim = self.hidden // self.heads
        out = [("token_embd.weight", (self.vocab, self.hidden))]
        for i in range(self.layers):
            out += [(f"blk.{i}.attn_norm.weight", (self.hidden,)),
                    (f"blk.{i}.attn_q.weight", (self.hidden, self.hidden)),
                    (f"blk.{i}.attn_k.weight", (self.kv_heads * head_dim, self.hidden)),
                    (f"blk.{i}.attn_v.weight", (self.kv_heads * head_dim, self.hidden)),
                    (f"blk.{i}.attn_output.weight", (self.hidden, self.hidden)),
                    (f"blk.{i}.ffn_norm.weight", (self.hidden,)),
                    (f"blk.{i}.ffn_gate.weight", (self.ffn, self.hidden)),
                    (f"blk.{i}.ffn_up.weight", (self.ffn, self.hidden)),
                    (f"blk.{i}.ffn_down.weight", (self.hidden, self.ffn))]
        return out + [("output_norm.weight", (self.hidden,)),
                      ("output.weight", (self.vocab, self.hidden))]


def _type_of(name: str, shape: tuple[int, ...], mix: dict[str, str]) -> str:
    if len(shape) == 1:
        return "F32"  # llama.cpp keeps norms in float32
    kind = name.split(".")[-2]
    return mix.get(kind, mix["default"])


def _nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return math.prod(shape) // block * size


def _random_data(type_name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    import gguf

    if type_name == "F32":
        values = rng.standard_normal(shape, dtype=np.float32)
        return values * np.float32(0.05) + (np.float32(1) if len(shape) == 1 else 0)
    if type_name == "F16":
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)).astype(np.float16)
    kind = gguf.GGMLQuantizationType[type_name]
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    data = np.frombuffer(rng.bytes(_nbytes(type_name, shape)), dtype=np.uint8).copy()
    blocks = data.reshape(-1, block_bytes)
    scales = (rng.random(blocks.shape[0], dtype=np.float32) * 1e-3 + 1e-4).astype(np.float16)
    for offset in _SCALE_OFFSETS[type_name]:
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return data.reshape(gguf.quants.quant_shape_to_byte_shape(shape, kind))


def _byte_level_vocabulary() -> tuple[list[str], list[str]]:
    """Three specials, the 256 byte tokens of a GPT-2 vocabulary and one merge: a tokenizer, as
    small as the weights are large (the tokenizer's conversion is not what is measured)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return ["<unk>", "<s>", "</s>", *bytes_to_unicode().values(), "\u0120t"], ["\u0120 t"]


def write_synthetic_gguf(path: Path, shape: Shape, mix: str = "q4_k_m", seed: int = 0) -> dict:
    """A Llama GGUF with random weights, written one tensor at a time (never all in memory)."""
    import gguf

    rng = np.random.default_rng(seed)
    types = {name: _type_of(name, dims, TYPE_MIXES[mix]) for name, dims in shape.tensors()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(shape.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens, merges = _byte_level_vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * 3 + [1] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, dims in shape.tensors():
        kind = gguf.GGMLQuantizationType[types[name]]
        raw = None if types[name] in ("F32", "F16") else kind
        stored = gguf.quants.quant_shape_to_byte_shape(dims, kind) if raw else dims
        dtype = {"F32": np.float32, "F16": np.float16}.get(types[name], np.uint8)
        writer.add_tensor_info(name, stored, np.dtype(dtype), _nbytes(types[name], dims), raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in shape.tensors():
        writer.write_tensor_data(_random_data(types[name], dims, rng))
    writer.close()
    return {"path": str(path), "bytes": path.stat().st_size, "types": types,
            "parameters": sum(math.prod(d) for _, d in shape.tensors()),
            "largest_tensor_float32_bytes": 4 * max(math.prod(d) for _, d in shape.tensors())}


def shape_for_size(size_bytes: int, mix: str, base: Shape = Shape()) -> Shape:
    """`base` with as many layers as bring the file to about `size_bytes`."""
    one = Shape(**{**base.__dict__, "layers": 1})
    two = Shape(**{**base.__dict__, "layers": 2})

    def file_bytes(s: Shape) -> int:
        return sum(_nbytes(_type_of(n, d, TYPE_MIXES[mix]), d) for n, d in s.tensors())

    per_layer = file_bytes(two) - file_bytes(one)
    fixed = file_bytes(one) - per_layer
    return Shape(**{**base.__dict__, "layers": max(1, round((size_bytes - fixed) / per_layer))})


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _convert_here(gguf_path: str, out_dir: str, dtype: str, weights_only: bool) -> None:
    """The child: resident memory before and at the peak, as JSON on the last line."""
    import gguf  # noqa: F401  (imported before the baseline, like torch)
    import torch  # noqa: F401

    from launcher.gguf import convert_gguf, write_model_files

    baseline = _kib("VmRSS")
    # "5" resets the peak to the current size: the imports' passing peak is not the converter's
    Path("/proc/self/clear_refs").write_text("5")
    started, cpu = time.monotonic(), time.process_time()
    weights_done = {}

    def progress(done: int, total: int) -> None:
        if done == total:
            weights_done.update(seconds=time.monotonic() - started,
                                peak_kib=_kib("VmHWM"))

    if weights_only:
        Path(out_dir).mkdir(parents=True)
        write_model_files(Path(gguf_path), Path(out_dir), progress, dtype=dtype)
    else:
        convert_gguf(Path(gguf_path), Path(out_dir), progress, dtype=dtype)
    print(json.dumps({"baseline_kib": baseline, "peak_kib": _kib("VmHWM"),
                      "seconds": time.monotonic() - started,
                      "cpu_seconds": time.process_time() - cpu,
                      "weights_seconds": weights_done.get("seconds"),
                      "weights_peak_kib": weights_done.get("peak_kib")}))


def measure_conversion(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16", *,
                       weights_only: bool = False) -> dict:
    """Converts in a fresh interpreter; its memory figures, times and the output's size."""
    args = [sys.executable, str(Path(__file__).resolve()), "--convert-here", str(gguf_path),
            str(out_dir), "--dtype", dtype] + (["--weights-only"] if weights_only else [])
    env = {**os.environ, "TQDM_DISABLE": "1"}
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"conversion failed: {done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["output_bytes"] = sum(f.stat().st_size for f in Path(out_dir).iterdir())
    figures["output_files"] = sorted(f.name for f in Path(out_dir).iterdir())
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="convert this file instead of a synthetic one")
    parser.add_argument("--size-gb", type=float, default=3.0, help="synthetic GGUF size")
    parser.add_argument("--types", choices=sorted(TYPE_MIXES), default="q4_k_m")
    parser.add_argument("--hidden", type=int, default=2048, help="synthetic model width")
    parser.add_argument("--vocab", type=int, default=32000, help="synthetic vocabulary size")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/gguf-convert-bench"))
    parser.add_argument("--keep", action="store_true", help="keep the GGUF and the output")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--convert-here", nargs=2, metavar=("GGUF", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--weights-only", action="store_true",
                        help="skip the tokenizer (transformers' import and its conversion)")
    args = parser.parse_args()
    if args.convert_here:
        _convert_here(*args.convert_here, args.dtype, args.weights_only)
        return

    args.work_dir.mkdir(parents=True, exist_ok=True)
    figures: dict = {}
    gguf_path = args.gguf
    if gguf_path is None:
        shape = shape_for_size(int(args.size_gb * 1e9), args.types,
                               Shape.of_width(args.hidden, args.vocab))
        gguf_path = args.work_dir / f"synthetic-{args.types}-{shape.layers}l.gguf"
        started = time.monotonic()
        figures["gguf"] = write_synthetic_gguf(gguf_path, shape, args.types)
        figures["gguf"]["write_seconds"] = time.monotonic() - started
        figures["gguf"].pop("types")
        print(f"synthetic GGUF: {figures['gguf']['bytes'] / 1e9:.2f} GB, {shape.layers} layers, "
              f"{figures['gguf']['parameters'] / 1e9:.2f} B parameters ({args.types}), written in "
              f"{figures['gguf']['write_seconds']:.0f} s", flush=True)
    out_dir = args.work_dir / f"converted-{args.dtype}"
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        figures["conversion"] = conversion = measure_conversion(
            gguf_path, out_dir, args.dtype, weights_only=args.weights_only)
    finally:
        if not args.keep:
            shutil.rmtree(out_dir, ignore_errors=True)
            if args.gguf is None:
                gguf_path.unlink(missing_ok=True)
    mib = 1 / 1024
    print(f"converted to {args.dtype}: {conversion['output_bytes'] / 1e9:.2f} GB in "
          f"{len([f for f in conversion['output_files'] if f.endswith('.safetensors')])} "
          f"safetensors file(s)")
    print(f"  weights: {conversion['weights_seconds']:.1f} s, peak RSS "
          f"{conversion['weights_peak_kib'] * mib:.0f} MiB")
    print(f"  total:   {conversion['seconds']:.1f} s ({conversion['cpu_seconds']:.1f} s CPU), "
          f"peak RSS {conversion['peak_kib'] * mib:.0f} MiB, of which "
          f"{conversion['baseline_kib'] * mib:.0f} MiB before converting (Python, torch, gguf)")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
