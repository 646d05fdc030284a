"""Pooling requests in the scheduler: prompt-only, finished (blocks freed) in the step that completes
the prompt; without chunked prefill, a prompt waits for a step with room for all of it."""

from __future__ import annotations

from llmserve.config import SchedulerConfig
from llmserve.contracts import FinishReason, ModelRunnerOutput, SchedulerOutput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from llmserve.scheduling.request import Request
from llmserve.scheduling.scheduler import Scheduler


def pooling_request(request_id: str, num_tokens: int) -> Request:
    tokens = list(range(1, num_tokens + 1))
    return Request(
        request_id, tokens, SamplingParams(max_tokens=1), None, 0.0, 4096, None, 0, PoolingParams()
    )


def pool(output: SchedulerOutput) -> ModelRunnerOutput:
    """A vector for each request whose prompt the step completed, as the pooling runners do."""
    return ModelRunnerOutput({}, pooled={s.request_id: b"v" for s in output.scheduled if s.samples})


def scheduled(output: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_new_tokens) for s in output.scheduled]


def test_without_chunking_a_prompt_waits_for_a_step_with_room_and_frees_its_blocks() -> None:
    manager = KVCacheManager(16, 4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=10), manager, 10, chunked_prefill=False)
    for request_id, n in (("a", 6), ("b", 5), ("c", 4)):
        scheduler.add_request(pooling_request(request_id, n))
    first = scheduler.schedule()
    assert scheduled(first) == [("a", 6)]  # b does not fit whole beside a: it waits, and c behind it
    outputs = scheduler.update_from_output(first, pool(first))
    assert [(o.request_id, o.finish_reason, o.pooling_output) for o in outputs] == [
        ("a", FinishReason.STOP, b"v")
    ]
    assert manager.num_free_blocks == 16 and not scheduler.running
    second = scheduler.schedule()
    assert scheduled(second) == [("b", 5), ("c", 4)]
    scheduler.update_from_output(second, pool(second))
    assert not scheduler.has_unfinished_requests() and manager.num_free_blocks == 16


def test_with_chunking_a_pooling_request_ends_after_its_last_chunk() -> None:
    manager = KVCacheManager(16, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8), manager, 64)
    scheduler.add_request(pooling_request("long", 20))
    chunks = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        chunks.append(scheduled(output))
        outputs = scheduler.update_from_output(output, pool(output))
    assert chunks == [[("long", 8)], [("long", 8)], [("long", 4)]]
    assert outputs[0].finish_reason == FinishReason.STOP and manager.num_free_blocks == 16
