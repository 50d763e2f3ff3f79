"""The benchmark tools run end to end (on a tiny model, with small sizes) and print their figures."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("kv_cache_dtype", ["", "int8"], ids=["model-dtype-kv", "int8-kv"])
def test_engine_benchmark(tiny_llama, tmp_path, kv_cache_dtype):
    out = _run(["benchmarks/engine_bench.py", "--model-dir", str(tiny_llama), "--dtype", "float32",
                "--batch-sizes", "1,4", "--prefill-batch-sizes", "1", "--prompt-lengths", "16",
                "--decode-prompt", "8", "--steps", "4", "--warmup", "1", "--prefill-repeats", "1",
                "--kv-cache-dtype", kv_cache_dtype, "--json", str(tmp_path / "engine.json")],
               tmp_path)
    assert "decode" in out and "tok/s" in out
    figures = json.loads((tmp_path / "engine.json").read_text())
    assert figures["kv_cache_dtype"] == (kv_cache_dtype or "float32")
    assert [row["batch"] for row in figures["decode"]] == [1, 4]
    assert all(row["tokens_per_s"] > 0 for row in figures["decode"])


def test_real_size_benchmark_plumbing(tmp_path):
    """benchmarks/gpu_real_size.py at a tiny shape on the CPU: the model made, served by the real
    launcher, measured and printed beside its floors (the 8B shape runs on a GPU only)."""
    out = _run(["benchmarks/gpu_real_size.py", "--shape", "tiny", "--device", "cpu",
                "--model-dir", str(tmp_path / "model"), "--streams", "2", "--prompt-lengths", "16",
                "--new-tokens", "4", "--single-repeats", "1", "--json",
                str(tmp_path / "real.json")], tmp_path)
    assert "floor allows" in out and "target: one-stream TPOT at 16 tokens" in out
    figures = json.loads((tmp_path / "real.json").read_text())
    single, wave = figures["rows"]
    assert (single["streams"], wave["streams"], wave["prompt"]) == (1, 2, 16)
    assert single["ttft_s"] > 0 and single["tpot_floor_s"] > 0 and wave["tokens_per_s"] > 0
    # keys and values, 2 bytes each, of 2 layers' 2 heads of 16
    assert figures["floors"]["kv_bytes_per_token"] == 2 * 2 * 2 * 2 * 16


def test_lora_benchmark(tiny_llama, tmp_path):
    """Every scenario timed at every batch size, each against the base, and issue 33's bounds
    stated at 32 streams."""
    out = _run(["benchmarks/lora_bench.py", "--model-dir", str(tiny_llama), "--rank", "4",
                "--batch-sizes", "2,32", "--decode-prompt", "8", "--steps", "2", "--warmup", "1",
                "--prefill-prompt", "8", "--prefill-repeats", "1", "--rounds", "1",
                "--adapter-cache", str(tmp_path / "adapters"), "--json",
                str(tmp_path / "lora.json")], tmp_path)
    assert "at 32 streams, 1 adapter (rank 4) cost" in out and "at most 25%):" in out
    figures = json.loads((tmp_path / "lora.json").read_text())
    decode = {(r["scenario"], r["batch"]): r for r in figures["rows"] if r["kind"] == "decode"}
    assert set(decode) == {(s, b) for s in ("base", "base_loaded", "one", "four") for b in (2, 32)}
    assert all(r["tokens_per_s"] > 0 for r in decode.values())
    assert decode[("base", 32)]["cost_percent"] == 0
    # the adapters' batches against the base batch decoding beside them, step for step
    assert all("cost_beside_percent" in decode[(s, b)] for s in ("one", "four") for b in (2, 32))
    assert {(r["scenario"], r["batch"]) for r in figures["rows"] if r["kind"] == "prefill"} == {
        (s, 4) for s in ("base", "base_loaded", "one", "four")}
    assert [(b["scenario"], b["limit_percent"]) for b in figures["bounds"]] == [("one", 15),
                                                                               ("four", 25)]
    assert len(list((tmp_path / "adapters").glob("*/r4-seed*/adapter_model.safetensors"))) == 4


def test_grammar_overhead_benchmark(tiny_llama, tmp_path):
    out = _run(["benchmarks/grammar_overhead.py", "--model-dir", str(tiny_llama), "--dtype",
                "float32", "--batch", "2", "--steps", "4", "--repeats", "1", "--json",
                str(tmp_path / "g.json")], tmp_path)
    assert "slowdown of the unconstrained requests" in out
    assert "slowdown_percent" in json.loads((tmp_path / "g.json").read_text())


@pytest.mark.e2e
def test_http_benchmark(tiny_llama, tmp_path):
    out = _run(["benchmarks/http_bench.py", "--model-dir", str(tiny_llama), "--dtype", "float32",
                "--concurrency", "2", "--requests", "2", "--prompt-tokens", "8",
                "--new-tokens", "4", "--routes", "generate_stream,completions",
                "--json", str(tmp_path / "h.json")], tmp_path)
    assert "tok/s" in out and "tgi-py / transformers" in out and "/v1/completions" in out
    figures = json.loads((tmp_path / "h.json").read_text())
    assert figures["server"]["output_tokens"] == 2 * 4
    assert figures["completions"]["output_tokens"] == 2 * 4


def test_http_benchmark_cuts_a_model_to_its_first_layers(tiny_llama, tmp_path):
    sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks.http_bench import cut_to_layers
    from shard.distributed import ParallelContext
    from shard.loader import load_model

    cut = cut_to_layers(tiny_llama, 1, parent=tmp_path)
    assert json.loads((cut / "config.json").read_text())["num_hidden_layers"] == 1
    assert (cut / "tokenizer.json").resolve() == (tiny_llama / "tokenizer.json").resolve()
    loaded = load_model(cut, dtype=torch.float32, device=torch.device("cpu"),
                        parallel=ParallelContext())
    assert len(loaded.model.layers) == 1
    with pytest.raises(SystemExit, match="--layers 99"):
        cut_to_layers(tiny_llama, 99, parent=tmp_path)


@pytest.mark.e2e
def test_http_benchmark_against_a_peer(tiny_llama, tmp_path):
    """--peer-url drives any OpenAI-compatible server, here a second tgi-py standing in for vLLM,
    started by --peer-command once ours has stopped."""
    from tests.e2e.server import free_port

    port = free_port()
    peer = (f"{sys.executable} -m launcher --model-id {tiny_llama} --port {port} --hostname "
            f"127.0.0.1 --shard-uds-path /tmp/tgi-py-peer-{port} --master-port {free_port()} "
            f"--model-registry-dir {tmp_path / 'registry'}")
    out = _run(["benchmarks/http_bench.py", "--model-dir", str(tiny_llama), "--dtype", "float32",
                "--concurrency", "2", "--requests", "2", "--prompt-tokens", "8", "--new-tokens",
                "4", "--routes", "completions", "--peer-url", f"http://127.0.0.1:{port}",
                "--peer-model", "whatever", "--peer-command", peer, "--no-baseline", "--json",
                str(tmp_path / "h.json"), "--prompts", "questions",
                "--server-arg=--speculate", "--server-arg=3"], tmp_path)
    assert "tgi-py completions / peer = " in out and "question prompts" in out
    figures = json.loads((tmp_path / "h.json").read_text())
    assert figures["peer"]["output_tokens"] == 2 * 4
    # both report their /metrics speculation counts; the peer, started without, drafted nothing
    assert set(figures["completions"]["speculation"]) == {"draft_tokens", "accepted_tokens"}
    assert figures["peer"]["speculation"] == {"draft_tokens": 0, "accepted_tokens": 0}
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.URLError) as stopped:  # the peer was stopped
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
    assert isinstance(stopped.value.reason, ConnectionRefusedError)


@pytest.mark.e2e
def test_peer_benchmark(tiny_llama, tmp_path):
    """One run: ours in bf16, then both peers (here tgi-py standing in for vLLM and llama.cpp,
    started by scripts taking the real ones' arguments), each stopped before the next; the
    ratios, and vLLM's --max-model-len raised in a copy of its script where the work needs it."""
    from tests.e2e.server import free_port

    def peer_script(name: str, extra: str = "") -> Path:
        script = tmp_path / f"{name}.sh"
        script.write_text(
            f"{extra}\nexec {sys.executable} -m launcher --model-id {tiny_llama} --port $2 "
            f"--hostname 127.0.0.1 --shard-uds-path /tmp/tgi-py-peer-$2 --master-port "
            f"{free_port()} --model-registry-dir {tmp_path / name} --dtype float32\n")
        return script

    out = _run(["benchmarks/peer_bench.py", "--model-dir", str(tiny_llama), "--skip", "int4",
                "--concurrency", "1,2", "--prompt-tokens", "8", "--new-tokens", "4",
                "--requests-per-stream", "1", "--min-requests", "1", "--gguf", "/dev/null",
                "--vllm-script", str(peer_script("vllm", "# --max-model-len 8")),
                "--llamacpp-script", str(peer_script("llamacpp")), "--log-dir", str(tmp_path),
                "--json", str(tmp_path / "p.json")], tmp_path)
    # the fake vLLM script's --max-model-len 8 raised to 8 + 4 tokens and 64 of room
    assert "tgi-py bf16 / vLLM-CPU bf16" in out and "--max-model-len 76" in out
    figures = json.loads((tmp_path / "p.json").read_text())
    assert list(figures["servers"]) == ["bf16", "vllm", "llamacpp"]
    for server in figures["servers"].values():
        assert "error" not in server
        assert [(r["concurrency"], r["requests"], r["output_tokens"]) for r in server["runs"]] == [
            (1, 1, 4), (2, 2, 8)]
        assert all(r["wave_ttft_p50_s"] > 0 for r in server["runs"])
    assert {(r["ours"], r["peer"], r["concurrency"]) for r in figures["ratios"]} == {
        ("bf16", "vllm", 1), ("bf16", "vllm", 2)}
    assert [t["target"] for t in figures["targets"]] == ["bf16 TPOT p50 at 1 stream"]


@pytest.mark.e2e
def test_peer_benchmark_long(tiny_llama, tmp_path):
    """--long: the decode step against the context, then long prompts and the wide short runs."""
    out = _run(["benchmarks/peer_bench.py", "--model-dir", str(tiny_llama), "--long", "--skip",
                "vllm", "--long-concurrency", "1", "--long-prompt-tokens", "24",
                "--long-new-tokens", "6", "--wide-concurrency", "3", "--prompt-tokens", "8",
                "--new-tokens", "4", "--requests-per-stream", "1", "--min-requests", "1",
                "--context-lengths", "8,40", "--context-steps", "2", "--context-rounds", "2",
                "--json", str(tmp_path / "p.json")], tmp_path)
    assert "decode step p50" in out
    figures = json.loads((tmp_path / "p.json").read_text())
    assert [row["context"] for row in figures["context"]] == [8, 40]
    runs = figures["servers"]["bf16"]["runs"]
    assert [(r["workload"], r["concurrency"], r["output_tokens"]) for r in runs] == [
        ("long", 1, 6), ("short", 3, 12)]


@pytest.mark.e2e
def test_chunked_prefill_benchmark(tiny_llama, tmp_path):
    out = _run(["benchmarks/chunked_prefill_bench.py", "--model-dir", str(tiny_llama), "--dtype",
                "float32", "--streams", "2", "--new-tokens", "200", "--long-tokens", "200",
                "--chunk", "32", "--json", str(tmp_path / "c.json")], tmp_path)
    assert "p99 / median" in out and "prefilled at once" in out
    figures = json.loads((tmp_path / "c.json").read_text())
    assert figures["chunked"]["itl_count"] > 0 and figures["whole"]["itl_max_s"] > 0


@pytest.mark.e2e
def test_prefix_cache_benchmark(tiny_llama, tmp_path):
    out = _run(["benchmarks/prefix_cache_bench.py", "--model-dir", str(tiny_llama), "--dtype",
                "float32", "--shared-tokens", "200", "--later", "2", "--json",
                str(tmp_path / "p.json")], tmp_path)
    assert "later / first" in out
    figures = json.loads((tmp_path / "p.json").read_text())
    assert set(figures) == {"on", "off"}


@pytest.mark.e2e
def test_soak(tiny_llama, tmp_path):
    """Seconds of mixed traffic (malformed requests and disconnects included): no unexpected
    outcome, no leaked KV block, and a report with all its sections."""
    done = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--model-dir", str(tiny_llama), "--dtype", "float32",
         "--minutes", "0.15", "--report-every", "3", "--warmup-seconds", "2", "--concurrency", "4",
         "--idle-seconds", "2", "--request-timeout", "20", "--json-out", str(tmp_path / "s.json"),
         "--", "--max-batch-total-tokens", "8192"],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    for section in ("rss MiB: router", "shard0", "(start)", "(end, after idle)", "outcomes:",
                    "requests/s", "tokens/s", "unexpected:", "rss growth from",
                    "kv blocks at idle:"):
        assert section in out, out
    assert out.strip().splitlines()[-1].startswith("SOAK PASS"), out
    figures = json.loads((tmp_path / "s.json").read_text())
    assert figures["requests"] == sum(figures["outcomes"].values()) > 0
    assert figures["outcomes"].get("ok", 0) > 0 and figures["tokens_per_s"] > 0
    assert len(figures["rss_mib"]) >= 4
    assert set(figures["rss_mib"][0]) == {"t_s", "router", "shard0"}
    assert figures["rss_growth_from_s"] is not None
    assert figures["unexpected"] == 0 and figures["kv_blocks"]["leaked"] == 0
    assert figures["is_server_alive"]


def test_hostile_load_benchmark(tiny_llama, tmp_path):
    """Every attacker runs beside normal requests, each answered as it should be, and both runs'
    latencies are printed; the exit code says whether the p99 bound held (noisy at this size)."""
    done = subprocess.run(
        [sys.executable, "benchmarks/hostile_load.py", "--model-dir", str(tiny_llama),
         "--seconds", "3", "--prompt-words", "100", "--json", str(tmp_path / "h.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads((tmp_path / "h.json").read_text())
    assert figures["broken"] == [], figures["outcomes"]
    assert done.returncode == int(figures["ratio"] > 1.5)
    assert "p99 attacked / quiet" in done.stdout
    seen = {label.split(":")[0] for label in figures["outcomes"]}
    assert seen == {"adapter_pattern", "grpc_unread", "sglang_hidden", "sglang_unread",
                    "adapter_churn", "template_loop", "template_alloc"}
    assert figures["outcomes"].get("template_loop: 422", 0) >= 1
    assert figures["outcomes"].get("template_alloc: 422", 0) >= 1
    assert any(label.startswith("adapter_churn: load 400") for label in figures["outcomes"])
    for run in ("quiet", "attacked"):
        assert set(figures[run]["statuses"]) == {"200"} and figures[run]["p99_ms"] > 0


@pytest.mark.e2e
def test_session_benchmark(tiny_llama, tmp_path):
    out = _run(["benchmarks/session_bench.py", "--model-dir", str(tiny_llama), "--dtype",
                "float32", "--history-tokens", "16,48", "--repeats", "2", "--json",
                str(tmp_path / "s.json")], tmp_path)
    assert "continuation / fresh" in out
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [r["history_tokens"] for r in rows] == [16, 48]
    assert all(r["continuation_ttft_s"] > 0 and r["decode_step_s"] > 0 for r in rows)


def test_quantize_quality_benchmark(tiny_llama, tmp_path):
    # the kinds in bf16, compared with the model in float32 (what transformers computes)
    out = _run(["benchmarks/quantize_quality.py", "--model-dir", str(tiny_llama), "--dtype",
                "bfloat16", "--reference", "float32", "--new-tokens", "3", "--prompts", "2",
                "--json", str(tmp_path / "q.json")], tmp_path)
    assert "bfloat16 activations" in out and "unquantized model in float32" in out
    assert "identical continuations" in out
    rows = json.loads((tmp_path / "q.json").read_text())
    assert set(rows) == {"float32", "int8", "int4"}
    assert all(math.isfinite(r["perplexity"]) for r in rows.values())
    assert 0 <= rows["int4"]["agreeing_tokens"] <= 1
    # an identical continuation agrees on every token; the reference is not compared to itself
    assert all(rows[k]["agreeing_tokens"] >= rows[k]["identical"] for k in ("int8", "int4"))
    assert "identical" not in rows["float32"]


def test_matmul_benchmark(tmp_path):
    from shard.kernels import bf16_matmul

    if bf16_matmul.load_library() is None:
        pytest.skip("the C bf16 matmul does not build here")
    out = _run(["benchmarks/matmul_bench.py", "--rows", "1,5", "--shapes", "o", "--rounds", "1",
                "--budget", "0.01"], tmp_path)
    assert "kernel form:" in out
    rows = [line for line in out.splitlines() if line.startswith("| o 576x576")]
    assert [line.split("|")[2].strip() for line in rows] == ["1", "5"]
    assert all(float(line.split("|")[3]) > 0 for line in rows)


def test_matmul_benchmark_of_a_decode_step(tmp_path):
    from shard.kernels import bf16_matmul

    if bf16_matmul.load_library() is None:
        pytest.skip("the C bf16 matmul does not build here")
    out = _run(["benchmarks/matmul_bench.py", "--step", "--layers", "1", "--rows", "1,3",
                "--rounds", "1"], tmp_path)
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| 1 ")
            or line.startswith("| 3 ")]
    assert [r[1].strip() for r in rows] == ["1", "3"] and all(float(r[2]) > 0 for r in rows)


def test_machine_limits_benchmark(tiny_llama, tmp_path):
    """The machine's bandwidth and multiply-add rate, and the floors they set for the model: a
    decode step's bytes over the bandwidth, a wave's prefill operations over the rate."""
    out = _run(["benchmarks/machine_limits.py", "--model-dir", str(tiny_llama), "--buffer-mb", "8",
                "--repeats", "1", "--fma-rounds", "100000", "--json", str(tmp_path / "m.json")],
               tmp_path)
    assert "GB/s" in out and "GFLOP/s" in out and "TTFT p50 at least" in out
    figures = json.loads((tmp_path / "m.json").read_text())
    bandwidth = figures["read"][-1]["best_gb_s"]
    gflops = figures["fma"][-1]["best_gflop_s"]
    assert bandwidth > 0 and gflops > 0
    config = json.loads((tiny_llama / "config.json").read_text())
    head = config["vocab_size"] * config["hidden_size"]
    assert figures["head_weights"] == head
    floors = figures["floors"]
    step_bytes = 2 * (figures["layer_weights"] + head)
    assert math.isclose(floors["decode_step_mb"]["bf16"], step_bytes / 1e6)
    assert math.isclose(floors["decode_step_floor_ms"]["bf16"], step_bytes / bandwidth / 1e6)
    wave = floors["wave"]
    flops = 32 * (128 * 2 * figures["layer_weights"] + 2 * head)
    assert math.isclose(wave["all_prefilled_s"], flops / gflops / 1e9)
    assert wave["all_prefilled_s"] / 2 < wave["ttft_p50_floor_s"] < wave["all_prefilled_s"]


@pytest.mark.real_model
def test_vision_benchmark(tmp_path):
    """Gemma 3's image costs on the tiny tower at 896 pixels: every figure present and positive."""
    _run(["benchmarks/vision_bench.py", "--shape", "tiny", "--repeats", "1", "--batches", "1,2",
          "--no-decode", "--model-dir", str(tmp_path / "model"), "--json",
          str(tmp_path / "vision.json")], tmp_path)
    figures = json.loads((tmp_path / "vision.json").read_text())
    assert {"preprocess_ms", "tower_ms_per_image_batch1", "tower_ms_per_image_batch2",
            "prefill_ms_one_image", "prefill_ms_same_length_text"} <= set(figures)
    assert all(v > 0 for k, v in figures.items() if k.endswith("_ms") or "_ms_" in k)
    assert figures["prompt_tokens_one_image"] == 268


@pytest.mark.real_model
def test_vision_benchmark_of_qwen2_5_vl(tmp_path):
    """Qwen2.5-VL's image costs on the tiny tower: a 1024x768 image is 999 tokens at the Hub's
    preprocessing, and every figure is present and positive."""
    _run(["benchmarks/vision_bench.py", "--family", "qwen2_5_vl", "--shape", "tiny",
          "--repeats", "1", "--batches", "1", "--no-decode", "--model-dir",
          str(tmp_path / "model"), "--json", str(tmp_path / "vision.json")], tmp_path)
    figures = json.loads((tmp_path / "vision.json").read_text())
    assert figures["tokens_per_image"] == 27 * 37
    assert figures["prompt_tokens_one_image"] == 27 * 37 + 12
    assert all(v > 0 for k, v in figures.items() if k.endswith("_ms") or "_ms_" in k)


def test_synthetic_gguf_shapes_follow_llama_cpps_q4_k_m(tmp_path, monkeypatch):
    """gguf_shapes writes llama.cpp's Q4_K_M types for a shape; the launcher serves the file."""
    import gguf

    from benchmarks import gguf_shapes
    from launcher.gguf import convert_gguf
    from launcher.gguf_file import read_gguf
    from launcher.known_models import DEFAULT_MODEL
    from launcher.model_cache import cache_root
    from launcher.prepare import fetch_gguf

    eight = {name: kind for name, _, kind in gguf_shapes.tensors(gguf_shapes.SHAPES["llama3-8b"])}
    wide = [i for i in range(32) if eight[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert wide == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert eight["output.weight"] == "Q6_K" and eight["blk.5.attn_q.weight"] == "Q4_K"
    monkeypatch.setitem(gguf_shapes.SHAPES, "tiny", dict(hidden=256, layers=2, heads=4,
                                                         kv_heads=2, ffn=512, vocab=50000,
                                                         tied=True))
    path = gguf_shapes.write("tiny", tmp_path / "tiny.gguf",
                             fetch_gguf(DEFAULT_MODEL, cache_root()))
    model = read_gguf(path)
    kinds = {t.name: gguf.GGMLQuantizationType(t.ggml_type).name for t in model.tensors}
    assert kinds["token_embd.weight"] == "Q6_K" and kinds["blk.0.ffn_up.weight"] == "Q4_K"
    assert len(model.metadata["tokenizer.ggml.tokens"]) == 50000
    converted = convert_gguf(path, tmp_path / "native", dtype="gguf")
    config = json.loads((converted / "config.json").read_text())
    assert config["quantization_config"]["file_type"] == "Q4_K_M"


def test_embedding_quantize_benchmark(tmp_path):
    """benchmarks/embedding_quantize.py on a tiny BERT: int8's cosine to float32 and the
    neighbours kept (with outlier rows apart, without, and in 7 bits), then the forward and each
    matmul of the first layer timed both ways."""
    from tests.embedding_models import build_tiny_bert

    model_dir = build_tiny_bert(tmp_path / "bert")
    out = _run(["benchmarks/embedding_quantize.py", "--model", str(model_dir), "--batch", "2",
                "--tokens", "16", "--rounds", "1", "--json", str(tmp_path / "quantize.json")],
               tmp_path)
    assert "int8: cosine to float32" in out and "forward of 2 x 16 tokens" in out
    figures = json.loads((tmp_path / "quantize.json").read_text())
    assert figures["sentences"] == 40 and 0.99 < figures["int8"]["cosine_min"] <= 1.0
    assert figures["int8_one_step"]["cosine_mean"] < 1.0
    assert figures["int8_7_bits"]["cosine_mean"] < figures["int8"]["cosine_mean"]
    assert [m["layer"] for m in figures["matmuls"]] == ["qkv", "out", "up", "down"]
    assert all(m["float32"] > 0 and m["int8"] > 0 for m in figures["matmuls"])
