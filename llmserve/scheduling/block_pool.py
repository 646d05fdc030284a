"""The fixed pool of KV cache blocks: who holds each block, and which are free."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVCacheBlock:
    """One block of `block_size` token slots in every layer's cache.

    `block_hash` is the hook for prefix caching: the chained hash of a full block's tokens, kept while
    the block is free so it can be reused; None for a block whose contents are not shareable.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """Owns every block. Free blocks sit in an ordered map so the least recently freed leaves first.

    Invariant: a block is in the free map exactly when its `ref_cnt` is 0.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV pool needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)

    @property
    def num_free_blocks(self) -> int:
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
            block.ref_cnt = 1
            block.block_hash = None
            out.append(block)
        return out

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference to each; blocks that reach zero go to the back of the free map."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"Block {block.block_id} freed more often than allocated.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
