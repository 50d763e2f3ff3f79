"""Images and the KV cache: blocks keyed on image content, and no cache hit or chunk inside an image."""
import asyncio
from types import SimpleNamespace

from router.core.generation import Infer
from router.kv.block_allocator import BlockAllocator, BlockPool
from router.kv.prefix_cache import PrefixCache, outside_images
from router.kv.sessions import SessionStore
from router.scheduler.batcher import Batcher
from router.scheduler.policy import ChunkedPrefill, SchedulingLimits
from router.scheduler.request_queue import QueueEntry, RequestQueue
from router.schemas import GenerateRequest, PromptImage, SamplingParams, StoppingParams
from router.telemetry.metrics import Metrics
from tests.fakes import FakeShardClient

IMAGE = 99  # the placeholder token: the same for every image
# 4 text tokens, an image of 6 tokens (4..9), 6 text tokens: 16 tokens, 4 blocks of 4
PROMPT = [1, 2, 3, 4] + [IMAGE] * 6 + [5, 6, 7, 8, 9, 10]


def _image(digest: bytes, offset: int = 4, count: int = 6) -> PromptImage:
    return PromptImage(b"file", digest, offset, count)


def _setup(num_blocks=40, block_size=4):
    pool = BlockPool(num_blocks, block_size)
    cache = PrefixCache(pool)
    return BlockAllocator(pool, [cache.evict]), cache


def test_the_same_image_reuses_its_blocks_and_another_never_does():
    allocator, cache = _setup()
    cat, dog = [_image(b"cat")], [_image(b"dog")]
    allocation = allocator.allocate(len(PROMPT))
    cache.insert(PROMPT, allocation.block_ids, images=cat)
    assert cache.match(PROMPT, images=cat) == allocation.block_ids
    # the first block holds only text before the image: shared; from the image's on, none
    assert cache.match(PROMPT, images=dog) == allocation.block_ids[:1]
    assert cache.match(PROMPT) == allocation.block_ids[:1]  # the placeholders as text
    text_only = allocator.allocate(len(PROMPT))
    cache.insert(PROMPT, text_only.block_ids)  # a text prompt of the same ids: its own blocks
    assert cache.match(PROMPT) == allocation.block_ids[:1] + text_only.block_ids[1:]
    assert cache.match(PROMPT, images=cat) == allocation.block_ids


def test_a_match_never_ends_inside_an_image():
    allocator, cache = _setup()
    cat = [_image(b"cat")]
    allocation = allocator.allocate(len(PROMPT))
    cache.insert(PROMPT, allocation.block_ids, images=cat)
    # the same start, then other text inside the image's third block (token 9 on): the blocks
    # that match cover 0..7, which ends inside the image (4..9): only the text block before it
    other = PROMPT[:9] + [50, 51, 52, 53, 54, 55, 56]
    assert cache.match(other, images=cat) == allocation.block_ids[:1]
    assert outside_images(8, cat) == 4 and outside_images(10, cat) == 10
    assert outside_images(4, cat) == 4


def test_the_queue_never_starts_a_prompt_inside_an_image():
    allocator, cache = _setup()
    queue = RequestQueue(allocator, cache)
    # the image ends the prompt but for one token: a full hit leaves the last block to compute,
    # which would start inside the image; the hit goes back to before it
    prompt = [1, 2, 3, 4] + [IMAGE] * 11 + [5]
    images = [_image(b"cat", 4, 11)]
    first = allocator.allocate(len(prompt))
    cache.insert(prompt, first.block_ids, images=images)
    entry = QueueEntry(id=0, input_length=len(prompt), max_new_tokens=4, prompt_ids=prompt,
                       prompt_images=images)
    queue.append(entry)
    plan = queue.next_batch(min_size=None, max_size=None, prefill_token_budget=100,
                            token_budget=1000)
    assert plan.entries == [entry] and entry.cache_len == 4


def test_a_chunk_ends_before_an_image_or_after_it():
    images = [_image(b"cat", 10, 20)]
    item = SimpleNamespace(input_length=40, prompt_images=images)
    chunk = ChunkedPrefill(item, next_start=0)
    assert chunk.next_size(16, None) == 10  # 0..16 would end inside 10..30: before it
    chunk.next_start = 10
    assert chunk.next_size(16, None) == 20  # starting at the image: all of it, past the budget
    chunk.next_start = 30
    assert chunk.next_size(16, None) == 10 and chunk.is_last(10)
    plain = ChunkedPrefill(SimpleNamespace(input_length=40, prompt_images=[]), next_start=0)
    assert plain.next_size(16, None) == 16


def test_a_session_keeps_its_images_with_its_tokens():
    pool = BlockPool(20, 4)
    store = SessionStore(pool)
    session = store.begin(("", "id"), "prompt")
    images = [_image(b"cat")]
    blocks = BlockAllocator(pool, []).allocate(len(PROMPT) + 2).block_ids
    store.keep(session, PROMPT + [11, 12], "ab", blocks, images=images)
    assert session.images == []  # pending until the call succeeds
    store.end(session, succeeded=True)
    assert session.images == images and session.token_ids[-2:] == [11, 12]


async def test_the_batcher_chunks_a_long_prompt_around_its_images():
    client = FakeShardClient()
    allocator = BlockAllocator(BlockPool(400, 4))
    limits = SchedulingLimits(max_batch_prefill_tokens=64, max_batch_total_tokens=10_000,
                              waiting_served_ratio=0.0, max_waiting_tokens=20, max_batch_size=None)
    metrics = Metrics(max_input_tokens=1000, max_total_tokens=2000)
    batcher = Batcher(client, RequestQueue(allocator, chunking=True), allocator, limits, metrics)
    infer = Infer(batcher, metrics, max_concurrent_requests=8)
    # an image across the first budget's end, and one longer than the budget
    images = [_image(b"a", 50, 40), _image(b"b", 120, 100)]
    request = GenerateRequest(inputs="x", input_ids=[5] * 300, sampling=SamplingParams(),
                              stopping=StoppingParams(max_new_tokens=2), images=images)
    task = asyncio.create_task(batcher.run())
    try:
        result = await asyncio.wait_for(infer.generate(request), timeout=10)
    finally:
        task.cancel()
    assert result.final.generated_tokens == 2
    ends = [start + length for name, (_, start, length) in
            (c for c in client.calls if c[0] == "chunk")]
    assert ends == [50, 114, 120, 220, 284]  # before an image or past it, never inside
    assert client.requests[0].request.images == images
