"""Per-request block tables on top of the `BlockPool`, with prefix caching and sliding-window frees."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

from llmserve.scheduling.block_pool import BlockHash, BlockPool, KVCacheBlock
from llmserve.scheduling.request import Request

# The id that stands, in a request's block table, for a block released behind its sliding window: a
# valid index into the cache, so tables stay in bounds, and never read there (attention starts at the
# block holding the window's first key). The pool's block of that id is unaffected: others may hold it.
PLACEHOLDER_BLOCK_ID = 0

# The parent digest of every request's first block: a fixed value, so that equal prefixes share blocks.
ROOT_BLOCK_HASH = bytes(32)


def hash_block(parent: BlockHash, token_ids: list[int], cache_salt: str | None = None) -> BlockHash:
    """SHA-256 over the parent's digest, the block's token ids (8 bytes each) and, for a first block,
    the request's `cache_salt` (UTF-8). A full block always packs `block_size` ids, so the salt after
    them cannot pass for tokens: a salted first block never matches an unsalted one or another salt's.
    A 64-bit hash would let a crafted prompt collide with another tenant's cached block."""
    data = parent + array("q", token_ids).tobytes()
    if cache_salt is not None:
        data += cache_salt.encode()
    return hashlib.sha256(data).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Gives each request enough blocks for the tokens it is about to compute, and takes them back.

    Block `i` of a request holds the KV of its tokens `[i * block_size, (i + 1) * block_size)`. With
    prefix caching, full blocks are registered under a SHA-256 digest chained over the parent block's
    digest and the block's token ids (`hash_block`), and a new request starts from the longest run of
    cached blocks matching its prefix. A request's `cache_salt` enters its first block's digest, so
    requests share cached blocks only when they carry the same salt (or none).

    With `sliding_window` W (every layer's: a query at position p reads the keys at (p - W, p]), a
    request's blocks wholly before the first new token's window are released as the window moves, as
    vLLM's SlidingWindowManager does, and a placeholder (`PLACEHOLDER_BLOCK_ID`) takes their place in
    its table, so block `i` still maps to its tokens. A released block keeps its hash while free, and
    a prefix is reused only when every one of its blocks is still cached (the chained lookup stops at
    the first miss); the new request then takes only the blocks its window reaches.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        resident_blocks: Callable[[], int] | None = None,
    ) -> None:
        """`resident_blocks`: how many blocks, from the first, have their memory resident (all if None;
        see `BlockPool`)."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}.")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, resident_blocks)
        self._placeholder = KVCacheBlock(PLACEHOLDER_BLOCK_ID)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_skipped: dict[str, int] = {}  # leading placeholders in _blocks
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}
        self.num_window_released = 0  # blocks released behind sliding windows, in all
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
        """Make room for `num_new_tokens` past the computed ones; False, and no other change, if the pool
        cannot. First the blocks behind the first new token's sliding window go back to the pool (nothing
        reads them again), whatever follows. A request admitted from the waiting queue passes its
        `get_computed_blocks()` (maybe empty) and starts after them; that admission is what the
        prefix-cache counters count."""
        blocks = self._blocks.setdefault(request.request_id, [])
        computed = computed_blocks or []
        num_computed = len(computed) * self.block_size if computed else request.num_computed_tokens
        behind = self._blocks_behind_window(num_computed)
        self._release_behind_window(request.request_id, blocks, behind)
        held = computed[behind:]  # of a cached prefix, the blocks the window reaches
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed)
        # Cached blocks that are free now stop being free once this request holds them.
        reclaimed = sum(1 for b in held if b.ref_cnt == 0)
        if needed > self.block_pool.num_free_blocks - reclaimed:
            return False
        if computed:
            self.block_pool.touch(held)
            blocks.extend([self._placeholder] * (len(computed) - len(held)) + held)
            self._num_skipped[request.request_id] = len(computed) - len(held)
            self._num_cached[request.request_id] = len(computed)
        if needed > 0:
            blocks.extend(self.block_pool.get_new_blocks(needed))
        if computed_blocks is not None and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed
        return True

    def _blocks_behind_window(self, position: int) -> int:
        """How many leading blocks lie wholly before the window of the query at `position` (and so of
        every later one): those before its first key, position - W + 1."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size

    def _release_behind_window(self, request_id: str, blocks: list[KVCacheBlock], behind: int) -> None:
        """Free the request's first `behind` blocks (those still held), leaving placeholders; the later
        ones first, so that a prefix's head stays cached longest."""
        done = self._num_skipped.get(request_id, 0)
        behind = min(behind, len(blocks))
        if behind <= done:
            return
        self.block_pool.free_blocks(list(reversed(blocks[done:behind])))
        blocks[done:behind] = [self._placeholder] * (behind - done)
        self._num_skipped[request_id] = behind
        self.num_window_released += behind - done

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

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Chained digests of the request's first `num_blocks` full blocks, each computed once and
        kept until the request is freed (extended as tokens arrive)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent, salt = (hashes[i - 1], None) if i else (ROOT_BLOCK_HASH, request.cache_salt)
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], salt))
        return hashes[:num_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table: id `PLACEHOLDER_BLOCK_ID` where a block was released behind the
        window."""
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Return every block the request holds to the pool (newest first, so that a shared prefix's
        head stays cached longest)."""
        blocks = self._blocks.pop(request.request_id, [])
        skipped = self._num_skipped.pop(request.request_id, 0)
        self._hashes.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self.block_pool.free_blocks(list(reversed(blocks[skipped:])))
