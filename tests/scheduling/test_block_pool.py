from __future__ import annotations

import pytest

from llmserve.scheduling.block_pool import BlockPool


def test_allocates_in_order_and_frees_to_the_back() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1]
    assert pool.num_free_blocks == 2
    pool.free_blocks([a[1], a[0]])
    # Blocks 2 and 3 were free longest, then 1, then 0.
    assert [b.block_id for b in pool.get_new_blocks(4)] == [2, 3, 1, 0]
    assert pool.usage == 1.0


def test_shared_block_stays_held_until_last_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second holder
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert pool.num_free_blocks == 2


def test_over_allocation_and_double_free_raise() -> None:
    pool = BlockPool(1)
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.get_new_blocks(2)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks(blocks)
