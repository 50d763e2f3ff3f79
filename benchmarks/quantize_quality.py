"""What --quantize int8|int4 and a GGUF served as stored cost in quality, against the unquantized
model in the same process: perplexity on a fixed text, and greedy agreement over a set of prompts
(identical continuations, and the share of tokens before the first difference).

The kind "gguf" is the model's GGUF served as stored (the launcher's default for a GGUF: its blocks
through our kernels), beside the float32 dequantization of the same file, which the other kinds
start from. `--reference float32` compares every kind with that model in float32 (what
transformers computes) rather than in `--dtype`; the kind "dense" is that model unquantized in
`--dtype`, which against a float32 reference shows what rounding the activations to bf16 alone
costs, and the kind "transformers" is transformers' own model of it in `--dtype` (greedy by its
`generate`). `--llama-cpp` adds llama.cpp's greedy text on the same GGUF
(`../shared/peers/llama-cpp.sh`, given the same token ids) to the comparison.

    python benchmarks/quantize_quality.py                     # SmolLM2-135M-Instruct, bf16
    python benchmarks/quantize_quality.py --model gemma3-270m --kinds gguf
    python benchmarks/quantize_quality.py --model gemma3-270m --kinds dense,transformers,gguf \
        --reference float32 --llama-cpp --prompts 16
    python benchmarks/quantize_quality.py --model-dir DIR --dtype float32 --new-tokens 16
"""
from __future__ import annotations

import argparse
import json
import math
import socket
import sys
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shard.distributed import ParallelContext  # noqa: E402
from shard.kv_budget import KVCacheSpec  # noqa: E402
from shard.loader import load_model  # noqa: E402
from shard.model_runner import ModelRunner, PrefillSequence  # noqa: E402

BLOCK = 16
# written for this benchmark: plain English prose, no code, nothing the model was tuned on verbatim
TEXT = (
    "The harbour town woke slowly on winter mornings. Before the bakery opened, the fishing boats "
    "had already gone out past the breakwater, their lamps still burning against the grey light. "
    "Children walked to school along the sea wall, stopping to watch the gulls fight over scraps "
    "near the market. By noon the wind usually turned, and the smell of salt and diesel gave way "
    "to bread and coffee. The old lighthouse keeper, who had retired years before the light was "
    "automated, still climbed the hill every afternoon to look at the water. He said he could tell "
    "the weather of the next day from the colour of the waves, and most of the time he was right. "
    "In the evenings the town gathered in the hall for concerts, council meetings and, once a "
    "month, a dance that lasted until the last bus had left. Visitors found the place quiet, even "
    "dull, but those who stayed through a whole year learned that every season had its own "
    "rhythm: the storms of January, the first tourists of May, the long light of July, and the "
    "return of the boats in October, heavy with the last catch before the cold.")
PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
    "Explain photosynthesis in one sentence.", "Once upon a time, in a small village,",
    "The three primary colours are", "List three uses of a paperclip:",
    "Translate to French: good morning", "The best way to learn a language is",
    "Q: What is 12 times 7?\nA:", "A recipe for pancakes starts with",
    "The planets of the solar system are", "Why is the sky blue?",
    "My favourite book is", "In 1969, humans first", "The quick brown fox",
]


def runner_for(model_dir: Path, dtype: torch.dtype, quantize: str | None):
    loaded = load_model(model_dir, dtype=dtype, device=torch.device("cpu"),
                        parallel=ParallelContext(), quantize=quantize)
    cfg = loaded.config
    runner = ModelRunner(loaded.model, KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                   cfg.head_dim, BLOCK, dtype,
                                                   torch.device("cpu")))
    runner.allocate(128)
    return runner, loaded.tokenizer, cfg.max_position_embeddings


def all_logits(runner, ids: list[int]) -> torch.Tensor:
    blocks = list(range(1, math.ceil(len(ids) / BLOCK) + 1))
    return runner.prefill([PrefillSequence(ids, 0, blocks)], all_logits_rows={0}).full[0].float()


def perplexity(runner, ids: list[int]) -> float:
    logits = all_logits(runner, ids)[:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


def greedy(runner, ids: list[int], new_tokens: int) -> list[int]:
    """A prefill, then one decode step per token: the paths a server runs (a decode step of one
    row multiplies by the quantized kernels themselves)."""
    blocks = list(range(1, math.ceil((len(ids) + new_tokens) / BLOCK) + 1))
    logits = runner.prefill([PrefillSequence(ids, 0, blocks)]).last
    out = [int(logits[0].argmax())]
    for _ in range(new_tokens - 1):
        logits = runner.decode(torch.tensor(out[-1:]), torch.tensor([len(ids) + len(out) - 1]),
                               torch.tensor([blocks])).logits
        out.append(int(logits[0].argmax()))
    return out


def agreement(answers: list[list[int]], reference: list[list[int]], new_tokens: int) -> dict:
    """Identical continuations and the tokens before the first difference, as shares.

    Also which prompts' continuations are identical."""
    same = [a == b for a, b in zip(answers, reference)]
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
              for a, b in zip(answers, reference)]
    return {"identical": sum(same) / len(same),
            "agreeing_tokens": sum(prefix) / (len(prefix) * new_tokens),
            "identical_prompts": [i for i, s in enumerate(same) if s]}


def transformers_row(model_dir: Path, dtype: torch.dtype, prompts: list[list[int]],
                     text_ids: list[int], new_tokens: int) -> tuple[dict, list[list[int]]]:
    """transformers' model of `model_dir` in `dtype`: its perplexity row, and its greedy tokens."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    # greedy and nothing else (a checkpoint's generation_config may ask for penalties), EOS
    # ignored as `greedy` ignores it
    plain = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    logits = model(torch.tensor([text_ids])).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(text_ids[1:]))
    answers = [model.generate(torch.tensor([ids]), generation_config=plain)[0, len(ids):].tolist()
               for ids in prompts]
    return {"perplexity": math.exp(nll.item()), "text_tokens": len(text_ids)}, answers


def llama_cpp_greedy(gguf: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """llama-server's greedy tokens for each prompt, given as token ids (no BOS added)."""
    from benchmarks.gguf_peer_bench import PEERS, stop
    from benchmarks.http_bench import start_peer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    process = start_peer(f"bash {PEERS / 'llama-cpp.sh'} {gguf} {port} 1", url, timeout=3600)
    try:
        answers = []
        for ids in prompts:
            body = json.dumps({"prompt": ids, "n_predict": new_tokens, "temperature": 0,
                               "top_k": 1, "ignore_eos": True, "cache_prompt": False,
                               "return_tokens": True}).encode()
            request = urllib.request.Request(f"{url}/completion", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as response:
                answers.append(json.loads(response.read())["tokens"])
        return answers
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="an unquantized model directory (no kind gguf then)")
    parser.add_argument("--model", default=None,
                        help="a short name of the launcher's (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--kinds", default="int8,int4,gguf")
    parser.add_argument("--reference", default="same", choices=["same", "float32"],
                        help="the unquantized model compared with: in --dtype, or in float32")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="add llama.cpp's greedy text on the model's GGUF (a known model)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    native_dir = gguf = None
    if args.model_dir is None:
        from launcher.known_models import DEFAULT_MODEL, known_model
        from launcher.prepare import prepare_known_model

        model = known_model(args.model) if args.model else DEFAULT_MODEL
        args.model_dir = prepare_known_model(model, dtype="float32")
        if "gguf" in kinds:
            native_dir = prepare_known_model(model, dtype="gguf")
        if args.llama_cpp:
            from launcher.model_cache import cache_root
            from launcher.prepare import fetch_gguf

            gguf = fetch_gguf(model, cache_root())
    elif args.llama_cpp:
        parser.error("--llama-cpp needs a known model (--model), not --model-dir")
    elif "gguf" in kinds:
        kinds.remove("gguf")
    dtype = getattr(torch, args.dtype)
    reference_name = args.dtype if args.reference == "same" else "float32"
    rows = {}
    reference = None
    with torch.inference_mode():
        for kind in [None, *[k for k in kinds if k != "transformers"]]:
            if kind == "gguf":
                runner, tokenizer, positions = runner_for(native_dir, dtype, None)
            elif kind == "dense":
                runner, tokenizer, positions = runner_for(args.model_dir, dtype, None)
            else:
                runner, tokenizer, positions = runner_for(
                    args.model_dir, getattr(torch, reference_name) if kind is None else dtype,
                    kind)
            text_ids = tokenizer.encode(TEXT).ids[:positions]
            prompts = [tokenizer.encode(p).ids for p in PROMPTS[:args.prompts]]
            answers = [greedy(runner, p, args.new_tokens) for p in prompts]
            row = {"perplexity": perplexity(runner, text_ids), "text_tokens": len(text_ids)}
            if reference is None:
                reference = answers
            else:
                row.update(agreement(answers, reference, args.new_tokens))
            rows[kind or reference_name] = row
            del runner
        if "transformers" in kinds:
            row, answers = transformers_row(args.model_dir, dtype, prompts, text_ids,
                                            args.new_tokens)
            rows["transformers"] = {**row, **agreement(answers, reference, args.new_tokens)}
    if gguf is not None:  # the reference's prompts, as its tokenizer (every kind's) reads them
        reference_prompts = [tokenizer.encode(p).ids for p in PROMPTS[:args.prompts]]
        rows["llama.cpp"] = agreement(llama_cpp_greedy(gguf, reference_prompts, args.new_tokens),
                                      reference, args.new_tokens)
    print(f"{args.model_dir.name}, {args.dtype} activations, perplexity on a fixed text of "
          f"{rows[reference_name]['text_tokens']} tokens, greedy {args.new_tokens} tokens over "
          f"{args.prompts} prompts against the unquantized model in {reference_name}")
    for name, row in rows.items():
        agreement_text = ("" if "identical" not in row else
                          f"   identical continuations {row['identical']:.0%}, tokens before the "
                          f"first difference {row['agreeing_tokens']:.0%}, identical "
                          f"{','.join(map(str, row['identical_prompts'])) or 'none'}")
        perplexity_text = (f"perplexity {row['perplexity']:7.3f}" if "perplexity" in row
                           else " " * 18)
        print(f"  {name:<12} {perplexity_text}{agreement_text}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
