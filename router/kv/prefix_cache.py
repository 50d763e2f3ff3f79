"""Reuse of computed prompt blocks: full KV blocks keyed by a hash chained to their predecessor.

A block's key covers every token before it, so equal keys mean equal prefixes (the tokens are kept
and compared as well, so a hash collision can never share wrong keys and values). A LoRA adapter
changes every key and value a prompt computes, so a request on an adapter starts its chain from
the adapter's name and matches only prefixes computed by that adapter (the base model's chain
starts from nothing, as it always has). An image's placeholder tokens are the same for every image,
so a block holding any of them is keyed on the digests of the images it holds as well: the same
image reuses its blocks, another never does; and a match never ends inside an image's tokens (the
shard puts a whole image's rows over its span in one prefill). The cache holds one reference to each block it knows; a
block only the cache holds is evicted least-recently-used when the pool runs short. Pure: no I/O.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from router.kv.block_allocator import BlockPool
from router.schemas import PromptImage

NO_IMAGES: tuple[PromptImage, ...] = ()


def outside_images(position: int, images: Sequence[PromptImage]) -> int:
    """`position` (a count of prompt tokens), moved back to the start of an image it is inside."""
    for image in images:  # spans never overlap: one move at most
        if image.token_offset < position < image.token_offset + image.token_count:
            return image.token_offset
    return position


@dataclass(slots=True)
class CachedBlock:
    block_id: int
    tokens: tuple[int, ...]
    parent_key: int | None
    adapter_id: str | None = None  # the LoRA adapter that computed it (None: the base model)
    images: tuple[bytes, ...] = ()  # digests of the images whose tokens it holds


class PrefixCache:
    """Cached prompt blocks by chained key; a reclaimer of the allocator (evict)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self._blocks: OrderedDict[int, CachedBlock] = OrderedDict()  # key -> block, LRU first

    def __len__(self) -> int:
        return len(self._blocks)

    def _keys(self, token_ids: list[int], adapter_id: str | None,
              images: Sequence[PromptImage] = NO_IMAGES):
        """(key, parent key, tokens, image digests) of each full block of `token_ids`.

        As computed by the base model, or by `adapter_id`, with `images` over their spans.
        """
        parent = None if adapter_id is None else hash(("lora", adapter_id))
        size = self.block_size
        for start in range(0, len(token_ids) - size + 1, size):
            tokens = tuple(token_ids[start:start + size])
            digests = tuple(i.digest for i in images
                            if i.token_offset < start + size and start < i.token_offset
                            + i.token_count)
            key = hash((parent, tokens, digests)) if digests else hash((parent, tokens))
            yield key, parent, tokens, digests
            parent = key

    def clear(self) -> None:
        """Forgets every block without letting go of them: for a pool about to be reset."""
        self._blocks.clear()

    def match(self, token_ids: list[int], *, adapter_id: str | None = None,
              images: Sequence[PromptImage] = NO_IMAGES) -> list[int]:
        """Block ids of the longest cached prefix of full blocks; the caller holds each once more.

        Only prefixes that `adapter_id` computed (None: the base model) with the same `images`
        match, and none ends inside an image's tokens.
        """
        found = []
        for key, _, tokens, digests in self._keys(token_ids, adapter_id, images):
            block = self._blocks.get(key)
            if (block is None or block.tokens != tokens or block.adapter_id != adapter_id
                    or block.images != digests):
                break
            self._blocks.move_to_end(key)
            found.append(block.block_id)
        found = found[:outside_images(len(found) * self.block_size, images) // self.block_size]
        self.pool.incref(found)
        return found

    def insert(self, token_ids: list[int], block_ids: list[int], *,
               adapter_id: str | None = None,
               images: Sequence[PromptImage] = NO_IMAGES) -> None:
        """Remembers the full blocks of a prompt; block_ids[i] holds its i-th block.

        They were computed by `adapter_id` (None: the base model), with `images`.
        """
        for (key, parent, tokens, digests), block_id in zip(
                self._keys(token_ids, adapter_id, images), block_ids):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self._blocks[key] = CachedBlock(block_id, tokens, parent, adapter_id, digests)
            self.pool.incref([block_id])

    def forget_adapter(self, adapter_id: str) -> None:
        """Lets go of every block `adapter_id` computed.

        It is unloaded, and an adapter loaded later under its name may compute other keys
        and values. A request still holding one of them keeps its own reference.
        """
        for key in [k for k, b in self._blocks.items() if b.adapter_id == adapter_id]:
            self.pool.decref([self._blocks.pop(key).block_id])

    def evict(self, needed: int) -> int:
        """Frees up to `needed` blocks that only the cache holds, least recently used first."""
        freed = 0
        for key in list(self._blocks):
            if freed >= needed:
                break
            block = self._blocks[key]
            if self.pool.ref_count(block.block_id) == 1:
                del self._blocks[key]
                self.pool.decref([block.block_id])
                freed += 1
        return freed
