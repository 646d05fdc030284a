"""Per-request block tables on top of the `BlockPool`."""

from __future__ import annotations

from llmserve.scheduling.block_pool import BlockPool, KVCacheBlock
from llmserve.scheduling.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Gives each request enough blocks for the tokens it is about to compute, and takes them back.

    Block `i` of a request holds the KV of its tokens `[i * block_size, (i + 1) * block_size)`.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` past the computed ones; False (and no change) if it cannot."""
        blocks = self._blocks.setdefault(request.request_id, [])
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(blocks)
        if needed <= 0:
            return True
        if needed > self.block_pool.num_free_blocks:
            return False
        blocks.extend(self.block_pool.get_new_blocks(needed))
        return True

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Return every block of the request to the pool (newest first, so older ones stay cached longer)."""
        blocks = self._blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(list(reversed(blocks)))
