"""The priority policy (admission order, preemption victim) and max_queue_time's expiry."""

from __future__ import annotations

import gc
import weakref

import pytest

from llmserve.config import SchedulerConfig, SchedulingPolicy
from llmserve.contracts import EngineCoreOutput, FinishReason
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from llmserve.scheduling.request import RequestStatus
from llmserve.scheduling.request_queue import FCFSQueue, PriorityQueue
from llmserve.scheduling.scheduler import Scheduler
from tests.scheduling.fake_requests import make_request
from tests.scheduling.test_scheduler import fake_run


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    policy: SchedulingPolicy = "priority",
    num_blocks: int = 64,
    block_size: int = 4,
    clock: FakeClock | None = None,
    **config: object,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(scheduling_policy=policy, **config),  # type: ignore[arg-type]
        KVCacheManager(num_blocks, block_size),
        max_model_len=4096,
        clock=clock or FakeClock(),
    )


def step(scheduler: Scheduler) -> list[EngineCoreOutput]:
    output = scheduler.schedule()
    return scheduler.update_from_output(output, fake_run(output))


@pytest.mark.parametrize(
    ("policy", "expected"), [("priority", ["d", "b", "c", "a"]), ("fcfs", ["a", "b", "c", "d"])]
)
def test_waiting_queue_orders_by_priority_then_arrival(policy: SchedulingPolicy, expected: list[str]) -> None:
    scheduler = make_scheduler(policy, max_num_seqs=1)
    for request_id, priority, arrival in (("a", 1, 0.0), ("b", 0, 1.0), ("c", 0, 2.0), ("d", -1, 3.0)):
        scheduler.add_request(
            make_request(request_id, 4, max_tokens=2, priority=priority, arrival_time=arrival)
        )
    order: list[str] = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        order += [s.request_id for s in output.scheduled if s.request_id not in order]
        scheduler.update_from_output(output, fake_run(output))
    assert order == expected


def test_priority_queue_breaks_ties_by_submission() -> None:
    queue = PriorityQueue()
    requests = [make_request(str(i), 1, priority=3, arrival_time=5.0) for i in range(4)]
    for r in requests:
        queue.add(r)
    queue.remove({requests[1]})
    assert [queue.pop().request_id for _ in range(len(queue))] == ["0", "2", "3"]


def test_fcfs_queue_puts_preempted_first_and_removes_many() -> None:
    queue = FCFSQueue()
    a, b, c = (make_request(x, 1) for x in "abc")
    queue.add(a)
    queue.add(b)
    queue.prepend(c)
    queue.remove({a, b})
    assert list(queue) == [c] and queue.peek() is c


@pytest.mark.parametrize(("policy", "victim"), [("priority", "low"), ("fcfs", "newest")])
def test_preemption_victim(policy: SchedulingPolicy, victim: str) -> None:
    # 6 blocks of 4 tokens: three requests of 7 prompt tokens take 2 blocks each; the first to need a
    # third block forces one out: the newest under fcfs, the largest (priority, arrival) otherwise.
    scheduler = make_scheduler(policy, num_blocks=6)
    requests = {
        "old": make_request("old", 7, max_tokens=6, priority=0, arrival_time=0.0),
        "low": make_request("low", 7, max_tokens=6, priority=1, arrival_time=1.0),
        "newest": make_request("newest", 7, max_tokens=6, priority=0, arrival_time=2.0),
    }
    for r in requests.values():
        scheduler.add_request(r)
    step(scheduler)  # all prefill, each samples token 8
    step(scheduler)  # token 9 fits in block 1 (position 7)
    output = scheduler.schedule()  # position 8 needs a third block: one request must go
    scheduler.update_from_output(output, fake_run(output))
    assert [r.request_id for r in requests.values() if r.status == RequestStatus.PREEMPTED] == [victim]
    assert victim not in [s.request_id for s in output.scheduled]
    assert requests[victim].num_computed_tokens == 0
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert all(r.num_output_tokens == 6 for r in requests.values())
    assert scheduler.kv_cache_manager.num_free_blocks == 6


def test_request_never_scheduled_within_max_queue_time_ends_unrun() -> None:
    clock = FakeClock()
    scheduler = make_scheduler("fcfs", num_blocks=8, clock=clock, max_num_seqs=1, max_queue_time=5.0)
    running = make_request("running", 8, max_tokens=50)
    scheduler.add_request(running)
    step(scheduler)
    free_before = scheduler.kv_cache_manager.num_free_blocks
    clock.now = 1.0
    scheduler.add_request(make_request("waiting", 8))  # deadline 6.0
    clock.now = 5.9
    assert [o.request_id for o in step(scheduler)] == ["running"]
    clock.now = 6.0
    scheduled = scheduler.schedule()
    assert scheduled.finished_request_ids == ["waiting"]  # the runner drops its state
    assert [s.request_id for s in scheduled.scheduled] == ["running"]
    outputs = scheduler.update_from_output(scheduled, fake_run(scheduled))
    assert outputs[0] == EngineCoreOutput("waiting", [], FinishReason.QUEUE_TIMEOUT)
    assert [o.request_id for o in outputs[1:]] == ["running"]
    assert "waiting" not in scheduler.requests and not scheduler.waiting
    assert scheduler.kv_cache_manager.get_block_ids("waiting") == []
    assert running.status == RequestStatus.RUNNING
    scheduler.finish_requests(["running"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == 8 > free_before


def test_requests_admitted_in_time_or_preempted_do_not_expire() -> None:
    clock = FakeClock()
    scheduler = make_scheduler("fcfs", num_blocks=4, clock=clock, max_queue_time=1.0)
    old, new = make_request("old", 7, max_tokens=6), make_request("new", 7, max_tokens=6)
    scheduler.add_request(old)
    scheduler.add_request(new)
    step(scheduler)
    step(scheduler)
    step(scheduler)  # new is preempted (see test_scheduler) and waits again
    assert new.status == RequestStatus.PREEMPTED
    clock.now = 100.0
    finished: dict[str, FinishReason | None] = {}
    while scheduler.has_unfinished_requests():
        finished |= {o.request_id: o.finish_reason for o in step(scheduler) if o.finished}
    assert finished == {"old": FinishReason.LENGTH, "new": FinishReason.LENGTH}
    assert scheduler.kv_cache_manager.num_free_blocks == 4


def test_expired_and_aborted_requests_leave_the_priority_queue() -> None:
    clock = FakeClock()
    scheduler = make_scheduler("priority", clock=clock, max_num_seqs=1, max_queue_time=2.0)
    scheduler.add_request(make_request("running", 4, max_tokens=50))
    step(scheduler)
    for i in range(4):
        scheduler.add_request(make_request(f"w{i}", 4, priority=-i, arrival_time=float(i)))
    assert scheduler.finish_requests(["w1", "w1", "gone"], RequestStatus.FINISHED_ABORTED) == ["w1"]
    clock.now = 2.0
    expired = [o.request_id for o in step(scheduler) if o.finish_reason == FinishReason.QUEUE_TIMEOUT]
    assert sorted(expired) == ["w0", "w2", "w3"]
    assert not scheduler.waiting and set(scheduler.requests) == {"running"}


def test_a_finished_request_is_not_kept_alive_until_its_queue_deadline() -> None:
    """The deadlines hold weak references: a request that ran and finished long before its deadline
    (its tokens, its grammar matcher) is freed when it finishes."""
    scheduler = make_scheduler("fcfs", max_queue_time=600.0)
    request = make_request("done", 4, max_tokens=1)
    scheduler.add_request(request)
    step(scheduler)
    assert not scheduler.has_unfinished_requests()
    finished = weakref.ref(request)
    del request
    gc.collect()
    assert finished() is None
