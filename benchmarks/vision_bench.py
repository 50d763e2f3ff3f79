"""What an image costs a Gemma 3 vision-language model: preprocessing, the tower, the prefill.

Random weights in Gemma 3's shapes, built with transformers and saved once: `--shape tiny` (the
test suite's kind of model: a 2-layer 32-wide tower at 896 pixels, a 3-layer 64-wide text model) or `--shape 4b` (Gemma 3 4B's
SigLIP so400m tower, 27 layers of width 1152 at 896 pixels, 14-pixel patches, 256 tokens per image,
with a small text model: the tower is what this measures). For each: preprocessing of a
1024x768 PNG, the tower and projector over 1, 2 and 4 images at once (per image), a prefill of one
prompt with one image against the same prompt's length in text, and decode tokens/s of a batch
with images beside one without.

    python benchmarks/vision_bench.py [--shape tiny|4b] [--dtype float32|bfloat16] [--repeats 3]
        [--batches 1,2,4] [--no-decode]
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shard.batch_state import NewRequest, PromptImage  # noqa: E402
from shard.sampling import SamplingParams  # noqa: E402
from tests.engine_helpers import BlockPool, make_engine  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402

SIDE, PATCH, PER_IMAGE = 896, 14, 256
IMAGE, BOI, EOI = 300, 301, 302
TOWERS = {"tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4),
          "4b": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                     num_attention_heads=16)}
# the language model beside each tower: the test suite's tiny one, or a small Gemma 3 (270M's
# widths, 6 layers) beside 4B's tower, which is what that shape measures
TEXTS = {"tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=4096, query_pre_attn_scalar=24, sliding_window=6),
         "4b": dict(vocab_size=320, hidden_size=640, intermediate_size=2048, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                    max_position_embeddings=4096, query_pre_attn_scalar=256,
                    sliding_window=512)}


def build(out_dir: Path, shape: str) -> Path:
    import transformers

    if (out_dir / "config.json").exists():
        return out_dir
    vision = dict(model_type="siglip_vision_model", image_size=SIDE, patch_size=PATCH,
                  **TOWERS[shape])
    config = transformers.Gemma3Config(text_config=TEXTS[shape], vision_config=vision,
                                       mm_tokens_per_image=PER_IMAGE, image_token_index=IMAGE,
                                       boi_token_index=BOI, eoi_token_index=EOI)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.02)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    return out_dir


def png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    picture = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize(
        (1024, 768), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    picture.save(out, "PNG")
    return out.getvalue()


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls, after one unmeasured."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompt(images: int) -> tuple[list[int], list[int]]:
    ids, offsets = [5, 6, 7, 8], []
    for _ in range(images):
        ids.append(BOI)
        offsets.append(len(ids))
        ids += [IMAGE] * PER_IMAGE + [EOI, 9, 10]
    return ids + [11, 12, 13, 14], offsets


def new_request(rid: int, ids: list[int], offsets: list[int], files: list[bytes],
                blocks: list[int], max_new: int) -> NewRequest:
    return NewRequest(id=rid, input_ids=ids, params=SamplingParams(), max_new_tokens=max_new,
                      ignore_eos=True, blocks=blocks,
                      images=[PromptImage(f, o, PER_IMAGE) for f, o in zip(files, offsets)])


def decode_rate(engine, pool: BlockPool, rid, files: list[bytes], with_images: bool) -> float:
    """Tokens/s of 32 decode steps of 8 requests whose prompts hold an image each (or none)."""
    ids, offsets = prompt(1)
    requests = [new_request(next(rid), ids if with_images else [20] * len(ids),
                            offsets if with_images else [], files[:1] if with_images else [],
                            pool.take(len(ids) + 33, 16), 33) for _ in range(8)]
    out = engine.prefill(2, requests)
    start = time.perf_counter()
    for _ in range(32):
        out = engine.decode([out.batch.id])
    rate = 8 * 32 / (time.perf_counter() - start)
    engine.clear()
    for made in requests:
        pool.give(made.blocks)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(TOWERS), default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--batches", default="1,2,4", help="images per tower call")
    parser.add_argument("--no-decode", action="store_true", help="skip the batch-of-8 decode")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    model_dir = build(args.model_dir or Path(f"/tmp/gemma3-vision-{args.shape}"), args.shape)
    dtype = getattr(torch, args.dtype)
    engine = make_engine(model_dir, block_size=16, num_blocks=2048, dtype=dtype)
    model, preprocess = engine.runner.model, engine.loaded.image_preprocessor
    files = [png(i) for i in range(max(4, *map(int, args.batches.split(","))))]
    result = {"shape": args.shape, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "preprocess_ms": 1e3 * timed(lambda: preprocess(files[0]), args.repeats)}
    pixels = torch.stack([preprocess(f) for f in files])
    with torch.inference_mode():
        for n in map(int, args.batches.split(",")):
            seconds = timed(lambda: model.embed_images(pixels[:n]), args.repeats)
            result[f"tower_ms_per_image_batch{n}"] = 1e3 * seconds / n
    pool, rid = BlockPool(2048), iter(range(1, 10**6))

    def prefill(images: int, text_only: bool) -> None:
        ids, offsets = prompt(images)
        if text_only:
            ids, offsets = [20 + i % 200 for i in range(len(ids))], []
        blocks = pool.take(len(ids) + 1, 16)
        out = engine.prefill(1, [new_request(next(rid), ids, offsets, files[:images], blocks, 1)])
        assert not out.rejected, out.rejected
        engine.clear()
        pool.give(blocks)

    result["prefill_ms_one_image"] = 1e3 * timed(lambda: prefill(1, False), args.repeats)
    result["prefill_ms_same_length_text"] = 1e3 * timed(lambda: prefill(1, True), args.repeats)
    result["prompt_tokens_one_image"] = len(prompt(1)[0])
    # alternated, medians of three: on a shared machine one run of each says little
    rates: dict[str, list[float]] = {"with_images": [], "without_images": []}
    for _ in range(0 if args.no_decode else 3):
        for label in rates:
            rates[label].append(decode_rate(engine, pool, rid, files, label == "with_images"))
    for label, values in rates.items():
        if values:
            result[f"decode_tok_s_batch8_{label}"] = statistics.median(values)
    print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
