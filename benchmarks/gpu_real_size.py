"""A Llama 3 8B-shaped model in bf16 served over HTTP, each figure beside the card's memory floor.

Random weights made on the device (nothing downloaded: a step's cost depends on the shapes, not
the values) and saved where the shard loads them; then the real launcher, router and shard serve
them. Measured through TGI's /generate_stream, each request exactly its prompt's tokens long and
exactly --new-tokens long (EOS ignored):

- one stream: time to first token (TTFT) and time per output token after it (TPOT), for each
  prompt length;
- tokens/s at each --streams count (one wave of that many requests at once), for each prompt
  length: output tokens over the wave's wall time, and its median TPOT; then the tokens/s while
  every request of the wave decodes (after the last first token, before the first end: the
  decode steps alone, which the floor is for), and the share of a core that the router, the
  shard and this client used over the wave (a Python process near 100% bounds the figures; but
  a host waiting on CUDA spins by default, so the shard's share counts its waits for the card).

The floor beside each figure is memory's: a decode step reads every weight once and the batch's
keys and values once (at their mean context), at the device's copy bandwidth measured here first
(a copy reads and writes each byte). A prefill's floor is the weights read once plus its keys and
values written once. The targets of issue 48 are said at the end (one-stream TPOT within 1.3x
its floor; at 64 streams, 70% of the tokens/s the floor allows; TTFT of a 2,048-token prompt
under 150 ms).

    python benchmarks/gpu_real_size.py --json $OUT/real-size.json
    python benchmarks/gpu_real_size.py --shape tiny --device cpu   # its plumbing, on any machine
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.http_bench import load, prompt_text, wait_until_ready  # noqa: E402
from tests.tiny_models import TINY_VOCAB, build_tokenizer  # noqa: E402

SHAPES = {
    "llama3-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                      positions=8192, rope_theta=500000.0),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=TINY_VOCAB,
                 positions=4096, rope_theta=10000.0),
}
TTFT_TARGET_S, TPOT_TARGET_RATIO, THROUGHPUT_TARGET, THROUGHPUT_STREAMS = 0.150, 1.3, 0.70, 64


def tensor_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    """transformers' LlamaForCausalLM names and shapes (an untied head)."""
    hidden, head_dim = shape["hidden"], shape["hidden"] // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    names = {"model.embed_tokens.weight": (shape["vocab"], hidden),
             "model.norm.weight": (hidden,), "lm_head.weight": (shape["vocab"], hidden)}
    for i in range(shape["layers"]):
        p = f"model.layers.{i}."
        names |= {p + "self_attn.q_proj.weight": (hidden, hidden),
                  p + "self_attn.k_proj.weight": (kv, hidden),
                  p + "self_attn.v_proj.weight": (kv, hidden),
                  p + "self_attn.o_proj.weight": (hidden, hidden),
                  p + "mlp.gate_proj.weight": (shape["ffn"], hidden),
                  p + "mlp.up_proj.weight": (shape["ffn"], hidden),
                  p + "mlp.down_proj.weight": (hidden, shape["ffn"]),
                  p + "input_layernorm.weight": (hidden,),
                  p + "post_attention_layernorm.weight": (hidden,)}
    return names


def make_model(out: Path, name: str, device: torch.device) -> Path:
    """Random bf16 weights of SHAPES[name], made on `device`, saved in `out` (kept for reruns)."""
    from safetensors.torch import save_file

    shape = SHAPES[name]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": shape["vocab"], "hidden_size": shape["hidden"],
              "intermediate_size": shape["ffn"], "num_hidden_layers": shape["layers"],
              "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
              "max_position_embeddings": shape["positions"], "rms_norm_eps": 1e-5,
              "rope_theta": shape["rope_theta"], "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    if (out / "config.json").exists() and json.loads((out / "config.json").read_text()) == config:
        return out
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator(device).manual_seed(0)
    index, part, files = {}, {}, 0

    def flush():
        nonlocal part, files
        file = f"model-{files:05d}.safetensors"
        save_file(part, str(out / file), metadata={"format": "pt"})
        index.update(dict.fromkeys(part, file))
        part, files = {}, files + 1

    for tensor_name, dims in tensor_shapes(shape).items():
        if len(dims) == 1:  # norms: ones, as a trained model's are near
            weight = torch.ones(dims, dtype=torch.bfloat16)
        else:
            weight = torch.empty(dims, dtype=torch.bfloat16, device=device)
            weight.normal_(0.0, 0.02, generator=generator)
            weight = weight.cpu()
        part[tensor_name] = weight
        if sum(t.numel() for t in part.values()) * 2 > 2 << 30:  # files of about 2 GiB
            flush()
    if part:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    build_tokenizer(out)
    (out / "config.json").write_text(json.dumps(config))  # last: the directory is complete
    return out


def copy_bandwidth(device: torch.device, size: int) -> float:
    """Bytes/s a device-to-device copy moves (each byte read and written), best of several."""
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * size / best


def floors(shape: dict, bandwidth: float) -> dict:
    """The bytes a step reads: the weights (the embedding table, of which a step reads a row a
    token, left out) and the keys and values of one token."""
    sizes = tensor_shapes(shape)
    weights = 2 * sum(torch.Size(d).numel() for n, d in sizes.items() if "embed_tokens" not in n)
    head_dim = shape["hidden"] // shape["heads"]
    kv_token = 2 * 2 * shape["layers"] * shape["kv_heads"] * head_dim  # k and v, bf16
    return {"bandwidth_bytes_s": bandwidth, "weight_bytes": weights, "kv_bytes_per_token": kv_token}


def step_floor(f: dict, streams: int, context: float) -> float:
    """Seconds a decode step of `streams` rows at a mean `context` takes at least."""
    read = f["weight_bytes"] + streams * context * f["kv_bytes_per_token"]
    return read / f["bandwidth_bytes_s"]


def start_server(model_dir: Path, device: str, args,
                 log_path: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    longest = max(args.prompt_lengths)
    command = [sys.executable, "-m", "launcher", "--model-id", str(model_dir), "--port", str(port),
               "--hostname", "127.0.0.1", "--device", device, "--dtype", "bfloat16",
               "--shard-uds-path", f"/tmp/tgi-py-real-size-{port}",
               "--max-input-tokens", str(longest),
               "--max-total-tokens", str(longest + args.new_tokens),
               "--max-batch-prefill-tokens", str(max(args.prefill_tokens, longest)),
               "--max-concurrent-requests", str(2 * max(args.streams)),
               "--max-batch-size", str(max(args.streams)), *args.server_arg]
    if device == "cuda":
        sizes = sorted({1, 2, 4, 8, 16, 32, 64, 128, 256} | set(args.streams))
        command += ["--cuda-graphs", ",".join(str(s) for s in sizes if s <= max(args.streams))]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_ready(process, f"{url}/health", args.start_timeout, f"the server (log: {log_path})")
    return process, url


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds the server's processes have used, by role (router, shard), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents, used, roles = {}, {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        pid = int(entry.name)
        parents[pid], used[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks
        roles[pid] = next((c.decode() for c in command if c in (b"router", b"shard")), "other")
    totals: dict[str, float] = {}
    for pid in used:
        walk = pid
        while walk in parents and walk != root:
            walk = parents[walk]
        if walk == root:
            totals[roles[pid]] = totals.get(roles[pid], 0.0) + used[pid]
    return totals


def wave(url: str, prompts: list[str], streams: int, length: int, args, server_pid: int) -> dict:
    """One wave of `streams` requests; its report, with the share of a core each process used."""
    before, client = cpu_seconds(server_pid), time.process_time()
    report = asyncio.run(load(url, prompts, streams, args.new_tokens, length, warm=False))
    after, client = cpu_seconds(server_pid), time.process_time() - client
    busy = {role: (after[role] - before.get(role, 0.0)) / report["wall_s"] for role in after}
    report["cores_busy"] = {**busy, "client": client / report["wall_s"]}
    return report


def measure(url: str, tokenizer, args, f: dict, report_row, server_pid: int) -> list[dict]:
    """Every figure of the run, each handed to `report_row` as soon as it is measured (a run cut
    short by its device time keeps what it had)."""
    rows, variant = [], 0

    def prompts(length: int, count: int) -> list[str]:
        nonlocal variant
        variant += count  # every request its own prefix: nothing comes from the prefix cache
        return [prompt_text(tokenizer, length, v) for v in range(variant - count, variant)]

    for length in args.prompt_lengths:
        report = asyncio.run(load(url, prompts(length, args.single_repeats), 1, args.new_tokens,
                                  length, warm_up=prompts(length, 1)[0]))
        context = length + args.new_tokens / 2
        prefill_floor = (f["weight_bytes"] + length * f["kv_bytes_per_token"]) / f[
            "bandwidth_bytes_s"]
        rows.append({"streams": 1, "prompt": length, "ttft_s": report["ttft_s"][50],
                     "ttft_floor_s": prefill_floor, "tpot_s": report["tpot_s"],
                     "tpot_floor_s": step_floor(f, 1, context)})
        report_row(rows)
        for streams in args.streams:
            report = wave(url, prompts(length, streams), streams, length, args, server_pid)
            floor = step_floor(f, streams, context)
            rows.append({"streams": streams, "prompt": length,
                         "tokens_per_s": report["output_tok_s"],
                         "all_decoding_tok_s": report["all_decoding_tok_s"],
                         "tokens_per_s_floor": streams / floor, "tpot_s": report["tpot_s"],
                         "tpot_floor_s": floor, "ttft_p50_s": report["ttft_s"][50],
                         "cores_busy": report["cores_busy"]})
            report_row(rows)
    return rows


def print_row(r: dict) -> list[str]:
    """One figure beside its floor; returns the issue's targets it bears on, met or not."""
    verdicts = []
    tpot = f"TPOT {r['tpot_s'] * 1e3:8.2f} ms (floor {r['tpot_floor_s'] * 1e3:.3g} ms, " \
           f"{r['tpot_s'] / r['tpot_floor_s']:5.2f}x)"
    if r["streams"] == 1:
        print(f"  1 stream,  {r['prompt']:>5}-token prompt: TTFT {r['ttft_s'] * 1e3:8.1f} ms "
              f"(memory floor {r['ttft_floor_s'] * 1e3:.3g} ms)   {tpot}")
        verdicts.append(f"one-stream TPOT at {r['prompt']} tokens: "
                        f"{r['tpot_s'] / r['tpot_floor_s']:.2f}x the floor (target "
                        f"<= {TPOT_TARGET_RATIO}x)")
        if r["prompt"] == 2048:
            verdicts.append(f"TTFT of a 2,048-token prompt: {r['ttft_s'] * 1e3:.1f} ms "
                            f"(target < {TTFT_TARGET_S * 1e3:.0f} ms)")
        return verdicts
    share = r["tokens_per_s"] / r["tokens_per_s_floor"]
    decoding = r["all_decoding_tok_s"]
    decoding_share = None if decoding is None else decoding / r["tokens_per_s_floor"]
    busy = ", ".join(f"{role} {share_of_core:.0%}" for role, share_of_core
                     in sorted(r["cores_busy"].items()) if share_of_core >= 0.01)
    print(f"  {r['streams']:>3} streams, {r['prompt']:>5}-token prompts: "
          f"{r['tokens_per_s']:9.1f} tok/s (floor allows {r['tokens_per_s_floor']:.4g}, "
          f"{share:6.1%})   {tpot}")
    print("      while all decode: " + ("too short to measure" if decoding is None else
                                         f"{decoding:9.1f} tok/s ({decoding_share:6.1%} of the "
                                         f"floor's)") + f"; a core's share busy: {busy}")
    if r["streams"] == THROUGHPUT_STREAMS:
        verdicts.append(f"{THROUGHPUT_STREAMS} streams at {r['prompt']} tokens: {share:.0%} "
                        f"of the floor's tokens/s over the wave, "
                        + ("-" if decoding is None else f"{decoding_share:.0%}")
                        + f" while all decode (target >= {THROUGHPUT_TARGET:.0%})")
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the random weights go (kept and reused: default /tmp/<shape>)")
    parser.add_argument("--streams", default="16,64,256",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-lengths", default="128,2048",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--single-repeats", type=int, default=3,
                        help="one-stream requests per prompt length (their median is reported)")
    parser.add_argument("--prefill-tokens", type=int, default=16384,
                        help="the server's --max-batch-prefill-tokens")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra launcher argument (repeatable)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--make-only", action="store_true",
                        help="make the model directory (if absent), print it and stop")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (--shape tiny --device cpu runs anywhere)")
    from tokenizers import Tokenizer

    device = torch.device(args.device)
    started = time.perf_counter()
    model_dir = make_model(args.model_dir or Path(f"/tmp/{args.shape}-random"), args.shape, device)
    made = time.perf_counter() - started
    if args.make_only:
        print(model_dir)
        return
    f = floors(SHAPES[args.shape], copy_bandwidth(device, (1 << 30) if args.device == "cuda"
                                                   else (64 << 20)))
    card = torch.cuda.get_device_name(device) if args.device == "cuda" else "cpu"
    print(f"{args.shape} (bf16, random) on {card}: weights {f['weight_bytes'] / 1e9:.2f} GB read "
          f"a step, KV {f['kv_bytes_per_token'] / 1e3:.1f} kB a token, copy bandwidth "
          f"{f['bandwidth_bytes_s'] / 1e9:.0f} GB/s (model made in {made:.0f} s)")
    log_path = (args.json.parent if args.json else Path("/tmp")) / "real-size-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server, url = start_server(model_dir, args.device, args, log_path)
    verdicts = []

    def report_row(rows: list[dict]) -> None:
        verdicts.extend(print_row(rows[-1]))
        if args.json:
            args.json.write_text(json.dumps({
                "shape": args.shape, "device": card, "torch": torch.__version__,
                "cuda": torch.version.cuda, "command": sys.argv, "floors": f, "rows": rows,
                "targets": verdicts}, indent=1))

    print(f"  server ready {time.perf_counter() - started:.0f} s after the start")
    try:
        measure(url, Tokenizer.from_file(str(model_dir / "tokenizer.json")), args, f, report_row,
                server.pid)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    for line in verdicts:
        print(f"  target: {line}")


if __name__ == "__main__":
    main()
