"""The fixed pool of KV cache blocks: who holds each block, which are free, and which free blocks
still hold a reusable prefix (prefix caching)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

# A full block's SHA-256 digest, chained over its parent's (see `kv_cache_manager.hash_block`).
BlockHash = bytes


@dataclass
class KVCacheBlock:
    """One block of `block_size` token slots in every layer's cache.

    `block_hash` is set once the block is full and computed: the digest chained over its parent block's
    digest and its own token ids. It stays while the block is free, so a later request with the same
    prefix can reuse the block, until the block is evicted for new content.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every block. Free blocks sit in an ordered map, least recently freed first: new blocks are
    taken (and cached contents evicted) from its front.

    Invariants: a block is in the free map exactly when its `ref_cnt` is 0; `cached` maps each hash
    to the one block holding it.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV pool needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._free):
            raise ValueError(f"Cannot allocate {n} blocks: only {len(self._free)} are free.")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:  # evict its cached contents
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_blocks(self, block_hashes: Iterable[BlockHash]) -> list[KVCacheBlock]:
        """The longest run of cached blocks for these chained hashes, from the first."""
        hits = []
        for block_hash in block_hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference to cached blocks, taking free ones out of the free map."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record a full, computed block. If another block already holds the same tokens, this one
        stays uncached (it is freed like any other)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference to each; blocks that reach zero go to the back of the free map."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"Block {block.block_id} freed more often than allocated.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
