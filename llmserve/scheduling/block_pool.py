"""The fixed pool of KV cache blocks: who holds each block, which are free, and which free blocks
still hold a reusable prefix (prefix caching)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
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
    """Owns every block. Blocks never handed out are taken first, in id order (they hold nothing to
    evict); blocks that were freed sit in an ordered map, least recently freed first, and are taken
    (their cached contents evicted) from its front.

    The memory behind the blocks may still be faulting in (`host_memory.populate_in_background`, which
    makes them resident in id order): `resident_blocks` says how many, from block 0, are there. A block
    never handed out beyond those is taken only when no freed one is left, so that requests write to
    memory that is already resident rather than fault it in mid-step.

    Invariants: a block is in the free map exactly when its `ref_cnt` is 0 and it was handed out
    before; `cached` maps each hash to the one block holding it.
    """

    def __init__(self, num_blocks: int, resident_blocks: Callable[[], int] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV pool needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._next_unused = 0  # blocks from this id on were never handed out
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._resident_blocks = resident_blocks or (lambda: num_blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evictable)."""
        return len(self._free) + self.num_blocks - self._next_unused

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot allocate {n} blocks: only {self.num_free_blocks} are free.")
        out = []
        for _ in range(n):
            block = self._take()
            if block.block_hash is not None:  # evict its cached contents
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def _take(self) -> KVCacheBlock:
        """A never-used block while those are resident, else the least recently freed one, else a
        never-used one whose memory faults in as it is written."""
        unused = self._next_unused < self.num_blocks
        if unused and (self._next_unused < self._resident_blocks() or not self._free):
            self._next_unused += 1
            return self.blocks[self._next_unused - 1]
        return self._free.popitem(last=False)[1]

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
