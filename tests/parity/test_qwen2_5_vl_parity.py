"""Qwen2.5-VL against `transformers` on a tiny random checkpoint, in float32.

Images of several sizes go in as PNG, JPEG or WebP bytes (made with Pillow), preprocessed by the
shard, against transformers' own processor's pixel values: logits of prompts with one and with
several images beside a text-only row (prefill, then decode steps at the rope delta), and greedy
decoding through the engine with a prefix-cache hit past an image and a prompt prefilled in
chunks that end at image span edges.

The tiny tower has windows of 2x2 tokens in its first block and the whole image in its second,
so an image of 3x5 tokens has windows cut by its edges; its sizes give grids of several shapes,
whose multimodal positions differ on each of the three rows.
"""
import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from shard.batch_state import PromptImage
from shard.distributed import ParallelContext
from shard.kv_budget import KVCacheSpec
from shard.loader import load_model
from shard.model_runner import ModelRunner, PrefillSequence
from shard.models.mrope import mrope_positions, rope_delta
from tests.engine_helpers import BlockPool, make_engine, request, run_to_completion
from tests.parity.test_gemma3_vision_parity import image_bytes
from tests.tiny_models import QWEN_VL_PIXELS, build_tiny_qwen2_5_vl

BLOCK_SIZE = 4
# the tiny tokenizer's added tokens: <|vision_start|>, <|vision_end|>, <|image_pad|>
START, END, IMAGE = 320, 321, 322
# 40x24 pixels -> 5x3 tokens; 20x60 -> 3x8; 33x33 -> 4x4; 120x20 -> 2x6 (max_pixels shrinks it)
FILES = [image_bytes(40, 24, "PNG", 1), image_bytes(20, 60, "JPEG", 2),
         image_bytes(33, 33, "WEBP", 3), image_bytes(120, 20, "PNG", 4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def reference(model_dir):
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def _processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**QWEN_VL_PIXELS)


def _grid(data: bytes) -> tuple[int, int]:
    """(rows, columns) of the image's tokens, as transformers' processor gives them."""
    grid = _processor()(Image.open(io.BytesIO(data)), return_tensors="pt")["image_grid_thw"][0]
    merge = QWEN_VL_PIXELS["merge_size"]
    return int(grid[1]) // merge, int(grid[2]) // merge


def with_images(text_ids: list[list[int]], files: list[bytes]) -> tuple[list[int], list[int]]:
    """Text runs with an image between each two -> (prompt ids, each image's first position)."""
    ids, offsets = list(text_ids[0]), []
    for run, data in zip(text_ids[1:], files):
        rows, columns = _grid(data)
        ids.append(START)
        offsets.append(len(ids))
        ids += [IMAGE] * (rows * columns) + [END] + run
    return ids, offsets


def _reference_kwargs(ids: list[int], files: list[bytes]) -> dict:
    ids_tensor = torch.tensor([ids])
    if not files:
        return dict(input_ids=ids_tensor)
    pixels = _processor()([Image.open(io.BytesIO(f)) for f in files], return_tensors="pt")
    return dict(input_ids=ids_tensor, pixel_values=pixels["pixel_values"],
                image_grid_thw=pixels["image_grid_thw"],
                mm_token_type_ids=(ids_tensor == IMAGE).int())


def _reference_logits(reference, ids: list[int], files: list[bytes]) -> torch.Tensor:
    reference.model.rope_deltas = None  # transformers keeps the last prompt's
    with torch.no_grad():
        return reference(**_reference_kwargs(ids, files)).logits[0]


def _images(loaded, files: list[bytes], offsets: list[int], *, pixels: bool = True):
    images = []
    for data, offset in zip(files, offsets):
        grid = loaded.image_preprocessor.grid(data)
        images.append(PromptImage(data, offset, grid[0] * grid[1],
                                  loaded.image_preprocessor(data) if pixels else None, grid))
    return images


def test_logits_match_transformers_with_one_and_several_images(model_dir, reference):
    """One prefill of three rows (one image, three of other sizes, none), then decode steps at
    each row's rope delta: every position's logits within 1e-4 of transformers' forward over
    the whole sequence."""
    loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                        parallel=ParallelContext())
    spec = KVCacheSpec(2, 2, 16, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, spec)
    runner.allocate(128)
    files = [[FILES[0]], FILES[1:], []]
    prompts = [with_images([[5, 17], [42, 99, 3]], files[0]),
               with_images([[7], [8, 9], [10, 11, 12], [13]], files[1]),
               ([20, 21, 22, 23, 24, 25, 26], [])]
    blocks = [list(range(1 + 40 * i, 41 + 40 * i)) for i in range(3)]
    seqs, deltas = [], []
    for (ids, offsets), fs, b in zip(prompts, files, blocks):
        images = _images(loaded, fs, offsets)
        deltas.append(rope_delta(images))
        seqs.append(PrefillSequence(ids, 0, b, images=images,
                                    rope_positions=mrope_positions(images, 0, len(ids))
                                    if images else None))
    assert deltas[0] < 0 and deltas[1] < deltas[0] and deltas[2] == 0
    out = runner.prefill(seqs, all_logits_rows={0, 1, 2})
    tokens = [list(ids) for ids, _ in prompts]
    ours = [[row] for row in out.full]
    next_ids = out.last.argmax(-1)
    seq_lens = torch.tensor([len(t) for t in tokens])
    for _ in range(5):
        for row, token in enumerate(next_ids.tolist()):
            tokens[row].append(token)
        step = runner.decode(next_ids, seq_lens, torch.tensor(blocks),
                             rope_deltas=torch.tensor(deltas)).logits
        for row in range(3):
            ours[row].append(step[row:row + 1])
        seq_lens, next_ids = seq_lens + 1, step.argmax(-1)
    for row in range(3):
        expected = _reference_logits(reference, tokens[row], files[row])
        assert (torch.cat(ours[row]) - expected).abs().max().item() <= 1e-4, row


def _greedy(reference, ids: list[int], files: list[bytes], max_new: int) -> list[int]:
    reference.generation_config.eos_token_id = None  # as ignore_eos
    reference.model.rope_deltas = None
    with torch.no_grad():
        out = reference.generate(**_reference_kwargs(ids, files), max_new_tokens=max_new,
                                 do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


def _request(rid: int, ids: list[int], offsets: list[int], files: list[bytes], blocks: list[int],
             max_new: int):
    made = request(rid, ids, blocks, max_new_tokens=max_new, ignore_eos=True)
    made.images = [PromptImage(f, offset, rows * columns)
                   for f, offset, (rows, columns) in zip(files, offsets, map(_grid, files))]
    return made


def test_greedy_decoding_through_the_engine_matches_transformers_generate(model_dir, reference):
    """A batch of rows with one image, two images and none; a prefix-cache hit past an image
    (the image is not recomputed, but its size still places the tokens after it); and a prompt
    prefilled in chunks ending at its images' span edges: transformers' greedy tokens for each
    prompt alone."""
    engine, pool, max_new = make_engine(model_dir, block_size=BLOCK_SIZE), BlockPool(512), 8
    files = [[FILES[0]], FILES[1:3], []]
    prompts = [with_images([[5, 17, 42], [99, 3, 7, 8]], files[0]),
               with_images([[30, 31], [32, 33], [34]], files[1]), ([40, 41, 42, 43, 44], [])]
    blocks = [pool.take(len(ids) + max_new, BLOCK_SIZE) for ids, _ in prompts]
    requests = [_request(i, ids, offsets, fs, b, max_new)
                for i, ((ids, offsets), fs, b) in enumerate(zip(prompts, files, blocks))]
    got = run_to_completion(engine, requests)
    for i, ((ids, _), fs) in enumerate(zip(prompts, files)):
        assert got[i] == _greedy(reference, ids, fs, max_new), i

    # the first prompt's image (5x3 tokens from 4) ends at 19: its first 5 blocks are shared
    ids, offsets = prompts[0]
    shared = ids[:5 * BLOCK_SIZE]
    follow = shared + [60, 61, 62]
    hit = _request(10, follow, offsets, files[0], blocks[0][:5]
                   + pool.take(len(follow) + max_new - len(shared), BLOCK_SIZE), max_new)
    hit.cache_len = len(shared)
    assert run_to_completion(engine, [hit], batch_id=2)[10] == _greedy(
        reference, follow, files[0], max_new)

    # chunks ending where each image's span starts and where it ends
    ids, offsets = prompts[1]
    ends = [o + n for o, n in zip(offsets, (r * c for r, c in map(_grid, files[1])))]
    edges = sorted({0, *offsets, *ends})
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


def _finish(engine, out, got: dict) -> None:
    """Decodes `out`'s batch to its end, adding each request's (token, logprob) to `got`."""
    while True:
        for g in out.generations:
            got.setdefault(g.request_id, []).extend(zip(g.tokens.ids, g.tokens.logprobs))
        finished = {g.request_id for g in out.generations if g.generated_text is not None}
        alive = [r for r in out.batch.request_ids if r not in finished] if out.batch else []
        if not alive:
            if out.batch is not None:
                engine.clear(out.batch.id)
            return
        if len(alive) < len(out.batch.request_ids):
            engine.filter(out.batch.id, alive)
        out = engine.decode([out.batch.id])


def test_a_running_batch_with_images_rides_in_a_prefill_with_another(model_dir, reference):
    """TGI's cached batch: rows whose prompts held an image (their own rope deltas) and a
    text-only row decode inside each forward that prefills a chunk of another image's prompt,
    then all decode together: each token and its logprob as each prompt gets alone, and the
    tokens transformers' greedy ones."""
    engine, pool, max_new = make_engine(model_dir, block_size=BLOCK_SIZE), BlockPool(512), 8
    files = [[FILES[0]], [], [FILES[3]]]
    prompts = [with_images([[5, 17], [42, 99]], files[0]), ([40, 41, 42], []),
               with_images([[7, 8], [9]], files[2])]

    def made(i: int):
        (ids, offsets), fs = prompts[i], files[i]
        return _request(i, ids, offsets, fs, pool.take(len(ids) + max_new, BLOCK_SIZE), max_new)

    alone: dict = {}
    for i in range(3):
        _finish(engine, engine.prefill(10 + i, [made(i)]), alone)
    got: dict = {}

    def keep(out) -> None:
        for g in out.generations:
            got.setdefault(g.request_id, []).extend(zip(g.tokens.ids, g.tokens.logprobs))

    out = engine.prefill(1, [made(0), made(1)])
    keep(out)
    ids, offsets = prompts[2]
    last = made(2)
    for start, end in [(0, offsets[0]), (offsets[0], len(ids) - 2)]:  # a chunk ends at the image
        chunk = made(2)
        chunk.blocks, chunk.cache_len, chunk.chunk_len = last.blocks, start, end - start
        out = engine.prefill(2 + start, [chunk], cached_batch_id=out.batch.id)
        assert [g.request_id for g in out.generations] == [0, 1]
        keep(out)
    last.cache_len = len(ids) - 2
    out = engine.prefill(5, [last], cached_batch_id=out.batch.id)
    assert out.batch.request_ids == [0, 1, 2]
    _finish(engine, out, got)
    for i, ((ids, _), fs) in enumerate(zip(prompts, files)):
        assert [t for t, _ in got[i]] == [t for t, _ in alone[i]] == _greedy(
            reference, ids, fs, max_new), i
        assert max(abs(a - b) for (_, a), (_, b) in zip(got[i], alone[i])) <= 1e-4, i


def test_speculative_steps_verify_drafts_at_each_rows_positions(model_dir, reference):
    """N-gram drafts verified past an image (each draft row at its request's rope delta):
    transformers' greedy tokens, with drafts checked along the way."""
    from tests.engine_helpers import steps_to_completion

    engine, pool, max_new = make_engine(model_dir, block_size=BLOCK_SIZE, speculate=3), \
        BlockPool(512), 24
    files = [[FILES[0]], FILES[1:3]]
    prompts = [with_images([[5, 17, 42], [99, 3, 7, 8]], files[0]),
               with_images([[30, 31], [32, 33], [34]], files[1])]
    made = [_request(i, ids, offsets, fs, pool.take(len(ids) + max_new, BLOCK_SIZE), max_new)
            for i, ((ids, offsets), fs) in enumerate(zip(prompts, files))]
    got, drafts = {0: [], 1: []}, 0
    for out in steps_to_completion(engine, made):
        drafts += out.draft_tokens or 0
        for g in out.generations:
            got[g.request_id] += g.tokens.ids
    assert drafts > 0
    for i, ((ids, _), fs) in enumerate(zip(prompts, files)):
        assert got[i] == _greedy(reference, ids, fs, max_new), i


def test_bad_images_are_refused_alone(model_dir):
    """A span whose length is not the image's grid, and files that are no image, are refused
    with the reason; the good request beside them goes on."""
    engine, pool = make_engine(model_dir, block_size=BLOCK_SIZE), BlockPool(512)
    ids, offsets = with_images([[5, 6], [7, 8]], [FILES[0]])
    cases = {1: [b""], 2: [b"plain text, not a picture"], 3: [FILES[2]]}
    requests = [_request(rid, ids, offsets, [FILES[0]], pool.take(len(ids) + 4, BLOCK_SIZE), 4)
                for rid in cases]
    for rid, fs in cases.items():
        requests[rid - 1].images[0].data = fs[0]
    good = _request(6, ids, offsets, [FILES[0]], pool.take(len(ids) + 4, BLOCK_SIZE), 4)
    out = engine.prefill(1, requests + [good])
    reasons = dict(out.rejected)
    assert "not an image" in reasons[1] or "empty" in reasons[1], reasons[1]
    assert "not an image" in reasons[2], reasons[2]
    assert "spans 15 tokens, but the model gives it 16" in reasons[3], reasons[3]
    assert [g.request_id for g in out.generations] == [6]


def test_checkpoints_naming_the_language_model_otherwise_load_the_same(model_dir, tmp_path):
    """transformers 4.52 to 4.57 saved Qwen2.5-VL as model.language_model.* and model.visual.*:
    the same tensors so named give the same logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "renamed"
    shutil.copytree(model_dir, renamed)
    tensors = {("model.language_model." + name[6:] if name.startswith("model.")
                else "model." + name if name.startswith("visual.") else name): value
               for name, value in load_file(str(model_dir / "model.safetensors")).items()}
    assert "model.language_model.embed_tokens.weight" in tensors
    save_file(tensors, str(renamed / "model.safetensors"), metadata={"format": "pt"})
    logits = []
    for directory in (model_dir, renamed):
        loaded = load_model(directory, dtype=torch.float32, device=torch.device("cpu"),
                            parallel=ParallelContext())
        runner = ModelRunner(loaded.model, KVCacheSpec(2, 2, 16, BLOCK_SIZE, torch.float32,
                                                       torch.device("cpu")))
        runner.allocate(16)
        ids, offsets = with_images([[5], [6, 7]], FILES[:1])
        images = _images(loaded, FILES[:1], offsets)
        logits.append(runner.prefill([PrefillSequence(
            ids, 0, list(range(1, 16)), images=images,
            rope_positions=mrope_positions(images, 0, len(ids)))], all_logits_rows={0}).full[0])
    assert torch.equal(*logits)


def _rank_logits(rank: int, world: int, port: int, model_dir: str, results) -> None:
    """One rank's logits of every position of a prompt with two images, and a text-only row."""
    from shard.distributed import init_parallel

    torch.set_num_threads(1)
    parallel = init_parallel(rank=rank, world_size=world, master_addr="127.0.0.1",
                             master_port=port, device=torch.device("cpu"))
    loaded = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"),
                        parallel=parallel)
    spec = KVCacheSpec(2, 2 // world, 16, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    runner = ModelRunner(loaded.model, spec)
    runner.allocate(32)
    ids, offsets = with_images([[5], [6, 7], [8]], FILES[:2])
    images = _images(loaded, FILES[:2], offsets)
    out = runner.prefill([PrefillSequence(ids, 0, list(range(1, 20)), images=images,
                                          rope_positions=mrope_positions(images, 0, len(ids))),
                          PrefillSequence([9, 10, 11], 0, [20])], all_logits_rows={0, 1})
    results[rank] = torch.cat(out.full)
    if world > 1:
        torch.distributed.destroy_process_group()


def test_two_shards_give_the_logits_of_one(model_dir):
    """--num-shard 2: the tower replicated on both ranks, the text split."""
    from tests.parity.test_tensor_parallel import assert_two_ranks_give_one_ranks

    assert_two_ranks_give_one_ranks(_rank_logits, model_dir)
