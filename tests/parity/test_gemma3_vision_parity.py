"""Gemma 3 with its vision tower against `transformers` on a tiny random checkpoint, in float32.

Images go in as PNG, JPEG or WebP bytes (made with Pillow), preprocessed by the shard, against
transformers' own processor's pixel values: logits of prompts with one and with several images
beside a text-only row (prefill, then decode steps), and greedy decoding through the engine with
a prefix-cache hit past an image and a prompt prefilled in chunks that end at image span edges.

The tiny model keeps what matters measurable: a sliding window shorter than an image's span (its
bidirectional tokens still see only their window), norms away from zero, a random projector (it
starts at zero), and 16 tokens per image pooled from an 8x8 patch grid.
"""
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shard.batch_state import PromptImage
from shard.distributed import ParallelContext
from shard.images.gemma3 import Gemma3Preprocessor
from shard.kv_budget import KVCacheSpec
from shard.loader import load_model
from shard.model_runner import ModelRunner, PrefillSequence
from tests.engine_helpers import BlockPool, make_engine, request, run_to_completion
from tests.tiny_models import TINY_IMAGE_TOKENS, build_tiny_gemma3_vision

BLOCK_SIZE = 4
IMAGE, BOI, EOI = (TINY_IMAGE_TOKENS[k] for k in ("image", "start", "end"))
PER_IMAGE, SIDE = TINY_IMAGE_TOKENS["per_image"], TINY_IMAGE_TOKENS["side"]


def image_bytes(width: int, height: int, fmt: str, seed: int) -> bytes:
    """A smooth random picture (a real one's kind of content) saved by Pillow as `fmt`."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    picture = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    picture.save(out, fmt)
    return out.getvalue()


def with_images(text_ids: list[list[int]]) -> tuple[list[int], list[int]]:
    """Text runs with an image between each two -> (prompt ids, each image's first position)."""
    ids, offsets = list(text_ids[0]), []
    for run in text_ids[1:]:
        ids.append(BOI)
        offsets.append(len(ids))
        ids += [IMAGE] * PER_IMAGE + [EOI] + run
    return ids, offsets


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3_vision"))


@pytest.fixture(scope="module")
def reference(model_dir):
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _pixels(files: list[bytes]) -> torch.Tensor:
    """transformers' pixel values for the files (its Pillow processor)."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    processor = Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE},
                                        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return processor([Image.open(io.BytesIO(f)) for f in files],
                     return_tensors="pt")["pixel_values"]


def _reference_logits(reference, ids: list[int], files: list[bytes]) -> torch.Tensor:
    ids_tensor = torch.tensor([ids])
    kwargs = {}
    if files:
        kwargs = dict(pixel_values=_pixels(files), token_type_ids=(ids_tensor == IMAGE).long())
    with torch.no_grad():
        return reference(input_ids=ids_tensor, **kwargs).logits[0]


FILES = [image_bytes(40, 30, "PNG", 1), image_bytes(25, 60, "JPEG", 2),
         image_bytes(32, 32, "WEBP", 3)]


def test_logits_match_transformers_with_one_and_several_images(model_dir, reference):
    """One prefill of three rows (one image, three images, none), then decode steps: every
    position's logits within 1e-4 of transformers' forward over the whole sequence."""
    loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                        parallel=ParallelContext())
    spec = KVCacheSpec(3, 2, 16, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, spec)
    runner.allocate(96)
    preprocess = loaded.image_preprocessor
    prompts = [with_images([[5, 17], [42, 99, 3]]),
               with_images([[7], [8, 9], [10, 11, 12], [13]]),
               ([20, 21, 22, 23, 24, 25, 26], [])]
    files = [[FILES[0]], FILES, []]
    blocks = [list(range(1 + 30 * i, 31 + 30 * i)) for i in range(3)]
    seqs = [PrefillSequence(ids, 0, b, images=[
        PromptImage(f, offset, PER_IMAGE, preprocess(f)) for f, offset in zip(fs, offsets)])
        for (ids, offsets), fs, b in zip(prompts, files, blocks)]
    out = runner.prefill(seqs, all_logits_rows={0, 1, 2})
    tokens = [list(ids) for ids, _ in prompts]
    ours = [[row] for row in out.full]
    next_ids = out.last.argmax(-1)
    seq_lens = torch.tensor([len(t) for t in tokens])
    for _ in range(5):
        for row, token in enumerate(next_ids.tolist()):
            tokens[row].append(token)
        step = runner.decode(next_ids, seq_lens, torch.tensor(blocks)).logits
        for row in range(3):
            ours[row].append(step[row:row + 1])
        seq_lens, next_ids = seq_lens + 1, step.argmax(-1)
    for row in range(3):
        expected = _reference_logits(reference, tokens[row], files[row])
        assert (torch.cat(ours[row]) - expected).abs().max().item() <= 1e-4, row


def _greedy(reference, ids: list[int], files: list[bytes], max_new: int) -> list[int]:
    reference.generation_config.eos_token_id = None  # as ignore_eos
    ids_tensor = torch.tensor([ids])
    kwargs = {}
    if files:
        kwargs = dict(pixel_values=_pixels(files), token_type_ids=(ids_tensor == IMAGE).long())
    with torch.no_grad():
        out = reference.generate(input_ids=ids_tensor, max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=2, **kwargs)
    return out[0, len(ids):].tolist()


def _request(rid: int, ids: list[int], offsets: list[int], files: list[bytes], blocks: list[int],
             max_new: int):
    made = request(rid, ids, blocks, max_new_tokens=max_new, ignore_eos=True)
    made.images = [PromptImage(f, offset, PER_IMAGE) for f, offset in zip(files, offsets)]
    return made


def test_greedy_decoding_through_the_engine_matches_transformers_generate(model_dir, reference):
    """A batch of rows with one image, two images and none; a prefix-cache hit past an image
    (the image is not recomputed: its bytes are not even valid); and a prompt prefilled in
    chunks ending at an image span's edges: transformers' greedy tokens for each prompt alone."""
    engine, pool, max_new = make_engine(model_dir, block_size=BLOCK_SIZE), BlockPool(512), 8
    prompts = [with_images([[5, 17, 42], [99, 3, 7, 8]]),
               with_images([[30, 31], [32, 33], [34]]), ([40, 41, 42, 43, 44], [])]
    files = [[FILES[0]], FILES[1:], []]
    blocks = [pool.take(len(ids) + max_new, BLOCK_SIZE) for ids, _ in prompts]
    requests = [_request(i, ids, offsets, fs, b, max_new)
                for i, ((ids, offsets), fs, b) in enumerate(zip(prompts, files, blocks))]
    got = run_to_completion(engine, requests)
    for i, ((ids, _), fs) in enumerate(zip(prompts, files)):
        assert got[i] == _greedy(reference, ids, fs, max_new), i

    # the first prompt's image ends at 21: its first 6 blocks (24 tokens) are cached and shared
    ids, offsets = prompts[0]
    shared = ids[:6 * BLOCK_SIZE]
    follow = shared + [60, 61, 62]
    hit = _request(10, follow, offsets, [b"not read: cached"], blocks[0][:6]
                   + pool.take(len(follow) + max_new - len(shared), BLOCK_SIZE), max_new)
    hit.cache_len = len(shared)
    assert run_to_completion(engine, [hit], batch_id=2)[10] == _greedy(
        reference, follow, [FILES[0]], max_new)

    # chunks ending where each image's span starts and where it ends
    ids, offsets = prompts[1]
    edges = sorted({0, *offsets, *(o + PER_IMAGE for o in offsets)})
    chunk_blocks = pool.take(len(ids) + max_new, BLOCK_SIZE)
    for start, end in zip(edges, edges[1:]):
        chunk = _request(11, ids, offsets, files[1], chunk_blocks, max_new)
        chunk.cache_len, chunk.chunk_len = start, end - start
        out = engine.prefill(20 + start, [chunk])
        assert out.rejected == [] and out.generations == [] and out.batch is None
    last = _request(11, ids, offsets, files[1], chunk_blocks, max_new)
    last.cache_len = edges[-1]
    assert run_to_completion(engine, [last], batch_id=3)[11] == _greedy(
        reference, ids, files[1], max_new)


def test_bad_images_are_refused_alone(model_dir):
    """Each request whose images cannot be computed is refused with the reason; the others in
    the same prefill go on."""
    engine, pool = make_engine(model_dir, block_size=BLOCK_SIZE), BlockPool(512)
    ids, offsets = with_images([[5, 6], [7, 8]])
    png = FILES[0]
    truncated = image_bytes(300, 200, "PNG", 9)[:400]
    cases = {1: ([b""], offsets, "empty"), 2: ([b"plain text, not a picture"], offsets,
                                                 "not an image"),
             3: ([truncated], offsets, "truncated"), 4: ([png], [offsets[0] + 1], "placeholder")}
    requests = [_request(rid, ids, at, fs, pool.take(len(ids) + 4, BLOCK_SIZE), 4)
                for rid, (fs, at, _) in cases.items()]
    good = _request(6, ids, offsets, [png], pool.take(len(ids) + 4, BLOCK_SIZE), 4)
    out = engine.prefill(1, requests + [good])
    reasons = dict(out.rejected)
    for rid, (_, _, word) in cases.items():
        assert word in reasons[rid], reasons[rid]
    assert [g.request_id for g in out.generations] == [6]
    split = _request(7, ids, offsets, [png], pool.take(len(ids) + 4, BLOCK_SIZE), 4)
    split.chunk_len = offsets[0] + 5
    assert "split" in dict(engine.prefill(2, [split]).rejected)[7]


def test_a_text_only_model_refuses_images(tmp_path):
    from tests.tiny_models import build_tiny_model

    engine = make_engine(build_tiny_model(tmp_path), block_size=BLOCK_SIZE)
    made = _request(1, [5, BOI] + [IMAGE] * PER_IMAGE + [EOI], [2], [FILES[0]],
                    list(range(1, 8)), 4)
    out = engine.prefill(1, [made])
    assert "takes no images" in dict(out.rejected)[1]


def test_preprocessing_reads_the_checkpoint_and_refuses_another_side(model_dir, tmp_path):
    preprocess = Gemma3Preprocessor.for_model(model_dir, SIDE)
    assert (preprocess.side, preprocess.mean, preprocess.resample) == (
        SIDE, (0.5, 0.5, 0.5), Image.Resampling.BILINEAR)
    (tmp_path / "preprocessor_config.json").write_text(
        '{"size": {"height": 896, "width": 896}, "image_mean": [0.5, 0.5, 0.5]}')
    with pytest.raises(ValueError, match="896"):
        Gemma3Preprocessor.for_model(tmp_path, SIDE)


def _rank_logits(rank: int, world: int, port: int, model_dir: str, results) -> None:
    """One rank's logits of every position of a prompt with two images (and a text-only row)."""
    from shard.distributed import init_parallel

    torch.set_num_threads(1)
    parallel = init_parallel(rank=rank, world_size=world, master_addr="127.0.0.1",
                             master_port=port, device=torch.device("cpu"))
    loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                        parallel=parallel)
    spec = KVCacheSpec(3, 2 // world, 16, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, spec)
    runner.allocate(32)
    ids, offsets = with_images([[5], [6, 7], [8]])
    images = [PromptImage(f, o, PER_IMAGE, loaded.image_preprocessor(f))
              for f, o in zip(FILES[:2], offsets)]
    out = runner.prefill([PrefillSequence(ids, 0, list(range(1, 12)), images=images),
                          PrefillSequence([9, 10, 11], 0, [12])], all_logits_rows={0, 1})
    results[rank] = torch.cat(out.full)
    if world > 1:
        torch.distributed.destroy_process_group()


def test_two_shards_give_the_logits_of_one(model_dir):
    """--num-shard 2: the tower and projector replicated on both ranks, the text split."""
    from tests.parity.test_tensor_parallel import assert_two_ranks_give_one_ranks

    assert_two_ranks_give_one_ranks(_rank_logits, model_dir)


def test_the_shards_info_says_how_a_prompt_holds_an_image(model_dir):
    """What the router expands each image into (a text-only model's Info leaves takes_images
    false)."""
    from shard.__main__ import build_engine
    from shard.config import ShardConfig

    _, _, info, _ = build_engine(ShardConfig(model_path=str(model_dir), dtype="float32",
                                          device="cpu"))
    assert (info.takes_images, info.image_token_id, info.image_tokens_per_image,
            info.image_start_token_id, info.image_end_token_id) == (True, IMAGE, PER_IMAGE, BOI,
                                                                    EOI)
    assert info.architecture == "Gemma3ForConditionalGeneration"


def test_a_prefill_messages_images_reach_the_engine(model_dir):
    """Request.images as the router sends them (file bytes, token_offset, token_count), through
    the servicer's conversion: the engine's tokens for the same request built in process."""
    from proto import generate_pb2 as pb
    from shard import convert

    ids, offsets = with_images([[5, 6], [7, 8], [9]])
    message = pb.Request(id=1, input_ids=ids, blocks=list(range(1, 12)),
                         parameters=pb.NextTokenChooserParameters(),
                         stopping_parameters=pb.StoppingCriteriaParameters(
                             max_new_tokens=4, ignore_eos_token=True),
                         images=[pb.Image(data=f, token_offset=o, token_count=PER_IMAGE)
                                 for f, o in zip(FILES[:2], offsets)])
    converted = convert.new_request(message, hidden_size=64)
    assert [(i.data, i.offset, i.count) for i in converted.images] == [
        (f, o, PER_IMAGE) for f, o in zip(FILES[:2], offsets)]
    engine = make_engine(model_dir, block_size=BLOCK_SIZE)
    expected = _request(2, ids, offsets, FILES[:2], list(range(20, 31)), 4)
    assert run_to_completion(engine, [converted])[1] == run_to_completion(
        engine, [expected], batch_id=2)[2]
