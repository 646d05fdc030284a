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


def test_blocks_never_used_go_first_while_resident_then_freed_ones_then_the_rest() -> None:
    """While the pool's memory is still faulting in, a request gets resident blocks: the never-used ones
    the populate thread has reached, then freed ones (which were written), and only then the rest."""
    resident = 2
    pool = BlockPool(6, lambda: resident)
    first = pool.get_new_blocks(2)
    assert [b.block_id for b in first] == [0, 1]
    pool.free_blocks(first)
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]  # freed, rather than 2 and 3
    resident = 4
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 4]  # 4: nothing freed is left
    assert pool.num_free_blocks == 1 and pool.usage == 5 / 6


def test_once_resident_the_order_is_never_used_first_then_least_recently_freed() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    pool.free_blocks([a[2], a[0]])
    assert [b.block_id for b in pool.get_new_blocks(3)] == [3, 2, 0]
