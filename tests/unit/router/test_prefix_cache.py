"""Prefix cache: chained block keys, references, LRU eviction, and the queue's use of it."""
from router.kv.block_allocator import BlockAllocator, BlockPool
from router.kv.prefix_cache import PrefixCache
from router.scheduler.request_queue import QueueEntry, RequestQueue


def _setup(num_blocks=20, block_size=4):
    pool = BlockPool(num_blocks, block_size)
    cache = PrefixCache(pool)
    return BlockAllocator(pool, [cache.evict]), cache


def test_match_returns_the_longest_cached_prefix_of_full_blocks():
    allocator, cache = _setup()
    prompt = list(range(10))  # two full blocks of 4, and 2 tokens over
    allocation = allocator.allocate(len(prompt))
    cache.insert(prompt, allocation.block_ids)
    assert len(cache) == 2
    assert cache.match(prompt) == allocation.block_ids[:2]
    assert cache.match(list(range(4)) + [99, 5, 6, 7]) == allocation.block_ids[:1]
    assert cache.match([99] + list(range(1, 10))) == []
    # the first block is chained into the second's key: same tokens after a different start miss
    assert cache.match([9, 9, 9, 9] + list(range(4, 8))) == []


def test_cached_blocks_outlive_their_request_and_are_evicted_lru_when_needed():
    allocator, cache = _setup(num_blocks=7, block_size=4)  # 6 usable
    first = allocator.allocate(8)
    cache.insert(list(range(8)), first.block_ids)
    allocator.free(first)
    assert allocator.num_free_blocks == 4, "the cache keeps the two prompt blocks"
    second = allocator.allocate(8)
    cache.insert(list(range(100, 108)), second.block_ids)
    allocator.free(second)
    assert cache.match(list(range(8)))  # touches the first prompt: now most recently used
    allocator.pool.decref(first.block_ids)
    big = allocator.allocate(16)  # needs 4 blocks; 2 free: evicts the least recently used two
    assert big is not None
    assert cache.match(list(range(100, 108))) == []
    assert cache.match(list(range(8))) == first.block_ids
    allocator.pool.decref(first.block_ids)
    allocator.free(big)
    assert cache.evict(10) == 2
    assert allocator.num_free_blocks == allocator.num_usable_blocks


def test_blocks_in_use_are_never_evicted():
    allocator, cache = _setup(num_blocks=5, block_size=4)
    held = allocator.allocate(8)
    cache.insert(list(range(8)), held.block_ids)
    assert cache.evict(2) == 0
    assert allocator.allocate(16) is None


def test_queue_reuses_a_cached_prefix_and_keeps_one_token_to_compute():
    allocator, cache = _setup(num_blocks=40, block_size=4)
    queue = RequestQueue(allocator, cache)
    prompt = list(range(12))  # exactly three blocks

    def entry(i, ids):
        return QueueEntry(id=i, input_length=len(ids), max_new_tokens=4, prompt_ids=ids)

    queue.append(entry(0, prompt))
    first = queue.next_batch(min_size=None, max_size=None, prefill_token_budget=100,
                             token_budget=1000)
    cache.insert(prompt, first.entries[0].allocation.block_ids)
    queue.append(entry(1, prompt))
    queue.append(entry(2, prompt + [50, 51, 52, 53, 54]))
    second = queue.next_batch(min_size=None, max_size=None, prefill_token_budget=100,
                              token_budget=1000)
    same, longer = second.entries
    assert same.cache_len == 8, "a whole-prompt hit still computes its last block"
    assert longer.cache_len == 12
    assert second.prefill_tokens == (12 - 8) + (17 - 12)
    assert same.allocation.block_ids[:2] == first.entries[0].allocation.block_ids[:2]
    for e in (first.entries[0], same, longer):
        allocator.free(e.allocation)
    cache.evict(100)
    assert allocator.num_free_blocks == allocator.num_usable_blocks, "no block leaked"
