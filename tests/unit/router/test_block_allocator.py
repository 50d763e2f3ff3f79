import random

from router.kv.block_allocator import BlockAllocator, BlockPool


def test_block_zero_is_never_handed_out_and_counts_add_up():
    allocator = BlockAllocator(BlockPool(num_blocks=9, block_size=4))
    a = allocator.allocate(10)  # 3 blocks
    b = allocator.allocate(16)  # 4 blocks
    assert 0 not in a.block_ids + b.block_ids
    assert len(set(a.block_ids + b.block_ids)) == 7
    assert allocator.num_free_blocks == 1
    assert not allocator.can_allocate(5)
    assert allocator.allocate(5) is None
    allocator.free(a)
    allocator.free(a)  # twice is harmless
    assert allocator.num_free_blocks == 4


def test_shared_blocks_return_only_when_every_holder_lets_go():
    allocator = BlockAllocator(BlockPool(num_blocks=5, block_size=2))
    first = allocator.allocate(4)
    second = allocator.share(first)
    allocator.free(first)
    assert allocator.num_free_blocks == 2
    allocator.free(second)
    assert allocator.num_free_blocks == 4


def test_no_leak_after_many_random_rounds():
    rng = random.Random(0)
    allocator = BlockAllocator(BlockPool(num_blocks=64, block_size=16))
    held = []
    for _ in range(5000):
        if held and rng.random() < 0.5:
            allocator.free(held.pop(rng.randrange(len(held))))
        else:
            allocation = allocator.allocate(rng.randint(1, 100))
            if allocation is not None:
                held.append(allocation)
        in_use = {b for a in held for b in a.block_ids}
        assert len(in_use) == sum(len(a.block_ids) for a in held), "a block is held twice"
        assert allocator.num_free_blocks + len(in_use) == allocator.num_usable_blocks
    for allocation in held:
        allocator.free(allocation)
    assert allocator.num_free_blocks == allocator.num_usable_blocks
