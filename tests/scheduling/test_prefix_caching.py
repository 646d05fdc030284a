from __future__ import annotations

from llmserve.config import SchedulerConfig
from llmserve.scheduling.block_pool import BlockPool
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from llmserve.scheduling.scheduler import Scheduler
from tests.scheduling.fake_requests import make_request
from tests.scheduling.test_scheduler import step


def digest(i: int) -> bytes:
    """A stand-in for a block's 32-byte SHA-256 digest."""
    return i.to_bytes(32, "big")


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    for block, h in ((a, 10), (b, 11), (c, 12)):
        pool.cache_block(block, digest(h))
    pool.free_blocks([b])
    pool.free_blocks([a])
    pool.free_blocks([c])
    assert pool.get_cached_blocks(map(digest, [10, 11, 12])) == [a, b, c]  # still reusable while free
    (first,) = pool.get_new_blocks(1)
    assert first is b and b.block_hash is None and digest(11) not in pool.cached
    assert pool.get_cached_blocks(map(digest, [10, 11])) == [a]


def test_a_shared_block_is_not_freed_while_referenced() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, digest(7))
    pool.touch([block])  # a second request reuses it
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1 and block.ref_cnt == 1
    pool.get_new_blocks(1)  # takes the other block, cannot evict the shared one
    assert pool.cached[digest(7)] is block
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1


def test_second_request_reuses_the_prefix_but_computes_its_last_token() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(SchedulerConfig(), manager, max_model_len=4096)
    first = make_request("a", 12, max_tokens=1)
    scheduler.add_request(first)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert manager.num_free_blocks == 16  # all free, 3 of them cached
    second = make_request("b", 12, max_tokens=1)  # the same 12 prompt tokens
    scheduler.add_request(second)
    output = scheduler.schedule()
    # Blocks 0 and 1 are reused; block 2 is full too, but the last token must be computed.
    assert second.num_computed_tokens == 8
    assert [(s.request_id, s.num_new_tokens) for s in output.scheduled] == [("b", 4)]
    assert output.scheduled[0].block_ids[:2] == manager.get_block_ids("b")[:2]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (24, 8)


def test_disabled_prefix_caching_reuses_nothing() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(), manager, max_model_len=4096)
    for request_id in ("a", "b"):
        scheduler.add_request(make_request(request_id, 12, max_tokens=1))
        assert step(scheduler).scheduled[0].num_new_tokens == 12
    assert manager.prefix_cache_hits == 0 and not manager.block_pool.cached
