"""The KV cache manager with a sliding window (W = 6, blocks of 4): a query at position p reads the keys at
(p - W, p], so a block ending before p - W + 1 of a request's first new token is released, and its table
holds the placeholder P there. Exact block ids: the pool hands out its least recently freed block first."""

from __future__ import annotations

import pytest

from llmserve.config import SchedulerConfig
from llmserve.scheduling.kv_cache_manager import PLACEHOLDER_BLOCK_ID as P
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from llmserve.scheduling.scheduler import Scheduler
from tests.scheduling.fake_requests import make_request
from tests.scheduling.test_scheduler import step

WINDOW, BLOCK_SIZE = 6, 4


def windowed(num_blocks: int, prefix_caching: bool = False) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, prefix_caching, sliding_window=WINDOW)


def test_blocks_behind_the_window_go_back_to_the_pool_as_it_moves() -> None:
    manager = windowed(8)
    request = make_request("a", 10, max_tokens=20)
    assert manager.allocate_slots(request, 10)
    assert manager.get_block_ids("a") == [0, 1, 2]
    expected = {  # first new position → table, blocks released so far
        10: ([P, 1, 2], 1),  # its first key is 5: block 0 (0..3) is behind
        11: ([P, 1, 2], 1),  # first key 6: block 1 (4..7) still read
        12: ([P, 1, 2, 3], 1),  # a new block for position 12, the least recently freed one
        13: ([P, P, 2, 3], 2),  # first key 8
    }
    for position, (table, released) in expected.items():
        request.num_computed_tokens = position
        assert manager.allocate_slots(request, 1)
        assert manager.get_block_ids("a") == table
        assert manager.num_window_released == released
        assert manager.num_free_blocks == 8 - sum(b != P for b in table)
    manager.free(request)  # the blocks still held, and only those (a double free would raise)
    assert manager.num_free_blocks == 8
    request.num_computed_tokens = 0  # preempted: recomputed from the start, with a fresh table
    assert manager.allocate_slots(request, 14)
    assert manager.get_block_ids("a") == [4, 5, 6, 7]


def test_blocks_released_together_leave_the_head_of_the_prefix_free_longest() -> None:
    """A prefix is reused only from its first block on, so that block should be the last evicted."""
    manager = windowed(8)
    request = make_request("a", 17)
    assert manager.allocate_slots(request, 16)
    request.num_computed_tokens = 16
    assert manager.allocate_slots(request, 1)  # first key 11: blocks 0 and 1 at once
    assert manager.get_block_ids("a") == [P, P, 2, 3, 4]
    other = make_request("b", 8)
    assert manager.allocate_slots(other, 8)
    assert manager.get_block_ids("b") == [5, 6]
    assert manager.allocate_slots(make_request("c", 4), 4)
    assert manager.get_block_ids("c") == [7]
    assert manager.allocate_slots(make_request("d", 4), 4)
    assert manager.get_block_ids("d") == [1]  # block 0 is still free


def test_a_sequence_longer_than_the_pool_runs_through() -> None:
    """38 tokens need 10 blocks without a window; with it, a decode holds at most 3 (its 6 keys span
    at most 3 blocks), so a pool of 4 runs the request without a preemption."""
    manager = windowed(4)
    scheduler = Scheduler(SchedulerConfig(), manager, max_model_len=4096)
    request = make_request("a", 8, max_tokens=30)
    scheduler.add_request(request)
    peak = 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
        peak = max(peak, 4 - manager.num_free_blocks)
    assert request.num_output_tokens == 30 and scheduler.num_preemptions == 0
    assert peak == 3
    assert manager.num_window_released == 7  # the last step computed position 36: blocks 0..6 behind
    assert manager.num_free_blocks == 4


def test_chunked_prefill_frees_only_what_the_next_chunk_cannot_see() -> None:
    """Chunks of 5: the chunk from position p needs the keys from p - 5 on."""
    manager = windowed(8)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=5), manager, max_model_len=4096)
    scheduler.add_request(make_request("a", 20, max_tokens=2))
    tables = [step(scheduler).scheduled[0].block_ids for _ in range(5)]
    assert tables == [
        [0, 1],  # positions 0..4
        [0, 1, 2],  # 5..9, reading from 0
        [P, 1, 2, 3],  # 10..14, reading from 5
        [P, P, 2, 3, 4],  # 15..19, reading from 10
        [P, P, P, 3, 4, 5],  # the decode at 20, reading from 15
    ]
    assert not scheduler.has_unfinished_requests()
    assert manager.num_window_released == 3 and manager.num_free_blocks == 8


def test_a_cached_prefix_is_taken_from_its_window_on() -> None:
    """A released block stays cached while free. A later request with the same prompt reuses the whole
    prefix but holds only the blocks its window reaches; once a block at the head of the prefix is
    evicted, nothing of it is reused, though later blocks are still cached (the chain stops there)."""
    manager = windowed(16, prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(), manager, max_model_len=4096)
    scheduler.add_request(make_request("a", 16, max_tokens=4))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert manager.num_window_released == 3  # blocks 0..2, once a decoded from position 18
    prompt_blocks = [manager.block_pool.blocks[i] for i in range(4)]
    assert all(b.ref_cnt == 0 and b.block_hash is not None for b in prompt_blocks)

    second = make_request("b", 16, max_tokens=4)
    scheduler.add_request(second)
    output = scheduler.schedule()
    # 3 blocks cached (the last token is computed); the first new token, 12, reads from 7: block 0 not.
    assert second.num_computed_tokens == 12
    assert output.scheduled[0].block_ids[:3] == [P, 1, 2]
    assert [b.ref_cnt for b in prompt_blocks[:3]] == [0, 1, 1]
    assert prompt_blocks[0] in manager.block_pool.cached.values()
    assert manager.prefix_cache_hits == 12

    filler = make_request("filler", manager.num_free_blocks * BLOCK_SIZE)
    assert manager.allocate_slots(filler, filler.num_tokens)  # evicts every free block, block 0 too
    assert prompt_blocks[0].block_hash is None and prompt_blocks[1].block_hash is not None
    assert manager.get_computed_blocks(make_request("c", 16)) == []


def test_the_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheManager(4, BLOCK_SIZE, sliding_window=0)
