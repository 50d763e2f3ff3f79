"""What an image costs a vision-language model: preprocessing, the tower, the prefill.

Random weights in a family's shapes, built with transformers and saved once. Gemma 3
(`--family gemma3`): `--shape tiny` (the test suite's kind of model: a 2-layer 32-wide tower at
896 pixels, a 3-layer 64-wide text model) or `--shape 4b` (Gemma 3 4B's SigLIP so400m tower, 27
layers of width 1152 at 896 pixels, 14-pixel patches, 256 tokens per image, with a small text
model: the tower is what this measures). Qwen2.5-VL (`--family qwen2_5_vl`): `--shape tiny` (a
2-layer 32-wide tower) or `--shape 3b` (Qwen2.5-VL 3B's tower: 32 layers of width 1280, windows of
112 pixels, full attention in 4 of them, beside a small text model), at the Hub's preprocessing
(a 1024x768 image is resized to 1036x756: 3,996 patches, 999 tokens). For each: preprocessing
of a 1024x768 PNG, the tower over 1, 2 and 4 images at once (per image), a prefill of one prompt
with one image against the same prompt's length in text, and decode tokens/s of a batch with
images beside one without.

    python benchmarks/vision_bench.py [--family gemma3|qwen2_5_vl] [--shape tiny|4b|3b]
        [--dtype float32|bfloat16] [--repeats 3] [--batches 1,2,4] [--no-decode]
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
# Qwen2.5-VL's towers (3B's widths; the tiny one of the test suite, at the Hub's preprocessing)
# and the text beside them (3B's width, 2 layers: the tower is what this measures)
QWEN_TOWERS = {"tiny": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                            out_hidden_size=64, fullatt_block_indexes=[1]),
               "3b": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                          out_hidden_size=2048, fullatt_block_indexes=[7, 15, 23, 31])}
QWEN_TEXTS = {"tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                            "mrope_section": [2, 3, 3]}),
              "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=2,
                         num_attention_heads=16, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [16, 24, 24]})}
# the Hub's preprocessor_config.json of Qwen2.5-VL
QWEN_PIXELS = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2,
                   temporal_patch_size=2)


def build(out_dir: Path, family: str, shape: str) -> Path:
    import transformers

    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(0)
    if family == "qwen2_5_vl":
        text = dict(vocab_size=320, max_position_embeddings=4096, bos_token_id=1,
                    eos_token_id=2, **QWEN_TEXTS[shape])
        model = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
            text_config=text, vision_config=dict(window_size=112, **QWEN_TOWERS[shape]),
            image_token_id=IMAGE, video_token_id=303, vision_start_token_id=BOI,
            vision_end_token_id=EOI, bos_token_id=1, eos_token_id=2))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "preprocessor_config.json").write_text(json.dumps(QWEN_PIXELS))
    else:
        vision = dict(model_type="siglip_vision_model", image_size=SIDE, patch_size=PATCH,
                      **TOWERS[shape])
        config = transformers.Gemma3Config(text_config=TEXTS[shape], vision_config=vision,
                                           mm_tokens_per_image=PER_IMAGE,
                                           image_token_index=IMAGE, boi_token_index=BOI,
                                           eoi_token_index=EOI)
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


def prompt(images: int, per_image: int) -> tuple[list[int], list[int]]:
    ids, offsets = [5, 6, 7, 8], []
    for _ in range(images):
        ids.append(BOI)
        offsets.append(len(ids))
        ids += [IMAGE] * per_image + [EOI, 9, 10]
    return ids + [11, 12, 13, 14], offsets


def new_request(rid: int, ids: list[int], offsets: list[int], files: list[bytes],
                blocks: list[int], max_new: int, per_image: int) -> NewRequest:
    return NewRequest(id=rid, input_ids=ids, params=SamplingParams(), max_new_tokens=max_new,
                      ignore_eos=True, blocks=blocks,
                      images=[PromptImage(f, o, per_image) for f, o in zip(files, offsets)])


def decode_rate(engine, pool: BlockPool, rid, files: list[bytes], with_images: bool,
                per_image: int) -> float:
    """Tokens/s of 32 decode steps of 8 requests whose prompts hold an image each (or none)."""
    ids, offsets = prompt(1, per_image)
    requests = [new_request(next(rid), ids if with_images else [20] * len(ids),
                            offsets if with_images else [], files[:1] if with_images else [],
                            pool.take(len(ids) + 33, 16), 33, per_image) for _ in range(8)]
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
    parser.add_argument("--family", choices=("gemma3", "qwen2_5_vl"), default="gemma3")
    parser.add_argument("--shape", choices=("tiny", "4b", "3b"), default="tiny")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--batches", default="1,2,4", help="images per tower call")
    parser.add_argument("--no-decode", action="store_true", help="skip the batch-of-8 decode")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    shapes = QWEN_TOWERS if args.family == "qwen2_5_vl" else TOWERS
    if args.shape not in shapes:
        parser.error(f"--family {args.family} has shapes {', '.join(shapes)}")
    model_dir = build(args.model_dir or Path(f"/tmp/{args.family}-vision-{args.shape}"),
                      args.family, args.shape)
    dtype = getattr(torch, args.dtype)
    engine = make_engine(model_dir, block_size=16, num_blocks=4096, dtype=dtype)
    model, preprocess = engine.runner.model, engine.loaded.image_preprocessor
    files = [png(i) for i in range(max(4, *map(int, args.batches.split(","))))]
    ragged = getattr(model, "ragged_images", False)  # Qwen2.5-VL: tokens by the image's size
    grid = preprocess.grid(files[0]) if ragged else None
    per_image = grid[0] * grid[1] if ragged else PER_IMAGE
    result = {"family": args.family, "shape": args.shape, "dtype": args.dtype,
              "threads": torch.get_num_threads(), "tokens_per_image": per_image,
              "preprocess_ms": 1e3 * timed(lambda: preprocess(files[0]), args.repeats)}
    pixels = [preprocess(f) for f in files]

    def tower(n: int):
        if ragged:
            return model.embed_images(pixels[:n], [grid] * n)
        return model.embed_images(torch.stack(pixels[:n]))

    with torch.inference_mode():
        for n in map(int, args.batches.split(",")):
            seconds = timed(lambda: tower(n), args.repeats)
            result[f"tower_ms_per_image_batch{n}"] = 1e3 * seconds / n
    pool, rid = BlockPool(4096), iter(range(1, 10**6))

    def prefill(images: int, text_only: bool) -> None:
        ids, offsets = prompt(images, per_image)
        if text_only:
            ids, offsets = [20 + i % 200 for i in range(len(ids))], []
        blocks = pool.take(len(ids) + 1, 16)
        out = engine.prefill(1, [new_request(next(rid), ids, offsets, files[:images], blocks, 1,
                                             per_image)])
        assert not out.rejected, out.rejected
        engine.clear()
        pool.give(blocks)

    result["prefill_ms_one_image"] = 1e3 * timed(lambda: prefill(1, False), args.repeats)
    result["prefill_ms_same_length_text"] = 1e3 * timed(lambda: prefill(1, True), args.repeats)
    result["prompt_tokens_one_image"] = len(prompt(1, per_image)[0])
    # alternated, medians of three: on a shared machine one run of each says little
    rates: dict[str, list[float]] = {"with_images": [], "without_images": []}
    for _ in range(0 if args.no_decode else 3):
        for label in rates:
            rates[label].append(decode_rate(engine, pool, rid, files, label == "with_images",
                                            per_image))
    for label, values in rates.items():
        if values:
            result[f"decode_tok_s_batch8_{label}"] = statistics.median(values)
    print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
