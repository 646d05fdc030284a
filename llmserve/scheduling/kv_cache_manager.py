"""Per-request block tables on top of the `BlockPool`, with prefix caching."""

from __future__ import annotations

from llmserve.scheduling.block_pool import BlockPool, KVCacheBlock
from llmserve.scheduling.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Gives each request enough blocks for the tokens it is about to compute, and takes them back.

    Block `i` of a request holds the KV of its tokens `[i * block_size, (i + 1) * block_size)`. With
    prefix caching, full blocks are registered under a hash chained over the parent block's hash and
    the block's token ids, and a new request starts from the longest run of cached blocks matching
    its prefix.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._hashes: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found cached

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Cached blocks for the request's prefix, leaving at least one token to compute (its logits
        are needed). Requests that want prompt logprobs compute everything."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        usable = (request.num_tokens - 1) // self.block_size
        return self.block_pool.get_cached_blocks(self._block_hashes(request, usable))

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None
    ) -> bool:
        """Make room for `num_new_tokens` past the computed ones; False, and no change, if the pool
        cannot. A request admitted from the waiting queue passes its `get_computed_blocks()` (maybe
        empty) and starts after them; that admission is what the prefix-cache counters count."""
        blocks = self._blocks.setdefault(request.request_id, [])
        computed = computed_blocks or []
        num_computed = len(computed) * self.block_size if computed else request.num_computed_tokens
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed)
        # Cached blocks that are free now stop being free once this request holds them.
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)
        if needed > self.block_pool.num_free_blocks - reclaimed:
            return False
        if computed:
            self.block_pool.touch(computed)
            blocks.extend(computed)
            self._num_cached[request.request_id] = len(computed)
        if needed > 0:
            blocks.extend(self.block_pool.get_new_blocks(needed))
        if computed_blocks is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full and computed (after a step)."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        done = self._num_cached.get(request.request_id, 0)
        if full <= done:
            return
        blocks = self._blocks[request.request_id]
        hashes = self._block_hashes(request, full)
        for i in range(done, full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self._num_cached[request.request_id] = full

    def _block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first `num_blocks` full blocks, extended as tokens arrive."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            hashes.append(hash((parent, tuple(tokens[i * bs : (i + 1) * bs]))))
        return hashes[:num_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Return every block of the request to the pool (newest first, so that a shared prefix's
        head stays cached longest)."""
        blocks = self._blocks.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks)))
