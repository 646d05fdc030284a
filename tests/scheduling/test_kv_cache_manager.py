from __future__ import annotations

from llmserve.scheduling.kv_cache_manager import KVCacheManager
from tests.scheduling.fake_requests import make_request


def test_allocates_blocks_as_tokens_grow_and_frees_all() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=4)
    request = make_request("a", 5)
    assert manager.allocate_slots(request, 5)
    assert manager.get_block_ids("a") == [0, 1]
    request.num_computed_tokens = 5
    assert manager.allocate_slots(request, 3)  # tokens 5..7 still fit in block 1
    assert manager.get_block_ids("a") == [0, 1]
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 1)
    assert manager.get_block_ids("a") == [0, 1, 2]
    manager.free(request)
    assert manager.num_free_blocks == 4
    assert manager.get_block_ids("a") == []


def test_refuses_without_partial_allocation() -> None:
    manager = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", 12)
    assert not manager.allocate_slots(request, 12)
    assert manager.num_free_blocks == 2
