"""What --quantize int8 costs an encoder in quality and gives it in speed, in one process.

Quality: 40 English sentences written for this benchmark (20 pairs, each a sentence and a
paraphrase of it) embedded by the shard's Embed path in float32 and in int8: each int8 vector's
cosine to its float32 one (the least and the mean), how many sentences keep their nearest
neighbour, and how many find their paraphrase as nearest neighbour under each. The same with
every row of a call rounded at one step (no outlier rows apart), and with activations in 7 bits
(what CPUs without AVX-512 VNNI get), for comparison.

Speed: the encoder's forward over --batch texts of --tokens tokens, and each of the first layer's
four matmuls over those rows, float32 (as served: oneDNN's packed matmuls) against int8,
alternated --rounds times, the best of each.

    python benchmarks/embedding_quantize.py                 # all-MiniLM-L6-v2
    python benchmarks/embedding_quantize.py --model DIR --rounds 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shard.layers import int8_dynamic  # noqa: E402

# pairs: a sentence, then a paraphrase of it
SENTENCES = [
    "The train to Edinburgh was delayed by forty minutes because of a signal failure.",
    "Our flight to Scotland left late after a problem with the aircraft's brakes.",
    "She planted tomatoes, basil and peppers in the raised beds behind the house.",
    "The vegetable garden needs watering every evening during a heatwave.",
    "Interest rates were raised by a quarter of a percentage point on Thursday.",
    "The central bank increased borrowing costs again to fight inflation.",
    "He fixed the leaking kitchen tap with a new washer and some plumber's tape.",
    "A dripping faucet usually means the rubber seal inside has worn out.",
    "The museum's new exhibition shows Roman coins found in a field in Norfolk.",
    "Archaeologists uncovered a hoard of ancient silver near a farm in England.",
    "Regular exercise lowers the risk of heart disease and improves sleep.",
    "Doctors recommend thirty minutes of walking a day for cardiovascular health.",
    "The compiler rejected the program because a variable was used before it was declared.",
    "Python raises a NameError when you refer to a name that has not been defined.",
    "Penguins huddle together to survive the Antarctic winter.",
    "Emperor penguins keep warm in blizzards by standing in tight groups.",
    "The orchestra rehearsed Beethoven's ninth symphony for the concert on Saturday.",
    "Musicians practised the choral symphony ahead of the weekend performance.",
    "Heavy rain caused the river to burst its banks and flood the town centre.",
    "Shops on the high street were damaged when floodwater rose overnight.",
    "The recipe calls for two eggs, a cup of flour and a pinch of salt.",
    "To make the batter, whisk the eggs with flour, milk and a little salt.",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "A probe launched last year has finally reached the red planet.",
    "Children in the village walk three miles to school every morning.",
    "Many pupils in rural areas travel long distances to reach their classrooms.",
    "The password must contain at least twelve characters, including a number.",
    "Choose a long passphrase and do not reuse it on other websites.",
    "The football match ended in a draw after a late equaliser in stoppage time.",
    "A goal in the final minute saved the home team from defeat.",
    "Bees are essential pollinators for many of the crops we eat.",
    "Without insects to carry pollen, fruit harvests would collapse.",
    "The library extended its opening hours during the exam period.",
    "Students can now study in the reading room until midnight.",
    "A strong earthquake shook the coastal city early this morning.",
    "Buildings swayed as a tremor struck the region before dawn.",
    "The new phone has a larger battery and a faster processor.",
    "The latest smartphone model lasts longer on a charge and runs apps more quickly.",
    "Tea was first brought to Europe by Dutch traders in the seventeenth century.",
    "Merchants from the Netherlands introduced the drink to European markets.",
]


def embedder(model_dir: Path, quantize: str):
    from shard.__main__ import build_engine
    from shard.config import ShardConfig

    _, embed, _, _ = build_engine(ShardConfig(model_path=str(model_dir), dtype="float32",
                                              quantize=quantize,
                                              uds_path="/tmp/tgi-py-embedding-quantize"))
    return embed


def vectors(embed, ids: list[list[int]]) -> torch.Tensor:
    out = embed.embed(list(enumerate(ids)))
    rows = torch.stack([out.vectors[i] for i in range(len(ids))]).double()
    return torch.nn.functional.normalize(rows, dim=-1)


def neighbours(v: torch.Tensor) -> torch.Tensor:
    similar = v @ v.T
    similar.fill_diagonal_(-2.0)
    return similar.argmax(dim=1)


def quality(reference: torch.Tensor, quantized: torch.Tensor) -> dict:
    cosine = (reference * quantized).sum(-1)
    pair = torch.arange(len(reference)) ^ 1  # 0 <-> 1, 2 <-> 3, ...
    near_ref, near_q = neighbours(reference), neighbours(quantized)
    return {"cosine_min": cosine.min().item(), "cosine_mean": cosine.mean().item(),
            "same_nearest": int((near_ref == near_q).sum()),
            "paraphrase_nearest_float32": int((near_ref == pair).sum()),
            "paraphrase_nearest_int8": int((near_q == pair).sum())}


def best_ms(runs: dict, rounds: int) -> dict:
    """Each callable's best time over `rounds` alternated rounds (after one call to warm)."""
    best = {name: float("inf") for name in runs}
    for run in runs.values():
        run()
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return {name: seconds * 1e3 for name, seconds in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="all-minilm-l6-v2", help="short name or model directory")
    p.add_argument("--batch", type=int, default=32, help="texts a forward")
    p.add_argument("--tokens", type=int, default=128, help="tokens a text")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    from launcher.known_models import known_model
    from launcher.prepare import prepare_known_model
    from router.inputs.tokenizer import RouterTokenizer
    from shard.malloc_tuning import keep_freed_memory

    keep_freed_memory()  # as the shard process does
    known = known_model(args.model)
    model_dir = prepare_known_model(known) if known is not None else Path(args.model)
    tokenizer = RouterTokenizer(str(model_dir))
    ids = [tokenizer.encode(text) for text in SENTENCES]
    full, int8 = embedder(model_dir, ""), embedder(model_dir, "int8")
    reference = vectors(full, ids)
    figures = {"model": args.model, "sentences": len(SENTENCES),
               "int8": quality(reference, vectors(int8, ids))}
    factor, full_range = int8_dynamic.OUTLIER_FACTOR, int8_dynamic._full_range
    int8_dynamic.OUTLIER_FACTOR = float("inf")  # every row of a call at one step
    figures["int8_one_step"] = quality(reference, vectors(int8, ids))
    int8_dynamic.OUTLIER_FACTOR = factor
    int8_dynamic._full_range = lambda: False  # as on a CPU without AVX-512 VNNI
    figures["int8_7_bits"] = quality(reference, vectors(int8, ids))
    int8_dynamic._full_range = full_range
    for name in ("int8", "int8_one_step", "int8_7_bits"):
        q = figures[name]
        print(f"{name}: cosine to float32 min {q['cosine_min']:.4f} mean {q['cosine_mean']:.4f}; "
              f"nearest neighbour kept {q['same_nearest']}/{len(SENTENCES)}; paraphrase "
              f"nearest {q['paraphrase_nearest_int8']} (float32 "
              f"{q['paraphrase_nearest_float32']})", flush=True)

    vocab = full.model.word.shape[0]
    torch.manual_seed(0)
    batch = torch.randint(1000 if vocab > 2000 else 3, vocab, (args.batch, args.tokens))
    lengths = torch.full((args.batch,), args.tokens)
    forward = best_ms({"float32": lambda: full.model.encode(batch, lengths),
                       "int8": lambda: int8.model.encode(batch, lengths)}, args.rounds)
    figures["forward_ms"] = forward
    print(f"forward of {args.batch} x {args.tokens} tokens: float32 {forward['float32']:.1f} ms, "
          f"int8 {forward['int8']:.1f} ms ({forward['float32'] / forward['int8']:.2f}x)",
          flush=True)
    rows = args.batch * args.tokens
    figures["matmuls"] = []
    with torch.inference_mode():
        for name in ("qkv", "out", "up", "down"):
            ours, theirs = (getattr(e.model.layers[0], name) for e in (full, int8))
            width = ours.layer.prepared.in_features
            x = torch.randn(rows, width)
            times = best_ms({"float32": lambda: ours(x), "int8": lambda: theirs(x)}, args.rounds)
            flops = 2 * rows * width * ours.layer.prepared.out_features
            figures["matmuls"].append({"layer": name, "in": width,
                                       "out": ours.layer.prepared.out_features, **times})
            print(f"  {name} [{rows} x {width}] -> {ours.layer.prepared.out_features}: "
                  f"float32 {times['float32']:.2f} ms ({flops / times['float32'] / 1e6:.0f} "
                  f"GFLOP/s), int8 {times['int8']:.2f} ms ({flops / times['int8'] / 1e6:.0f}; "
                  f"{times['float32'] / times['int8']:.2f}x)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
