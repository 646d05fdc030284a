from __future__ import annotations

from typing import Any

from llmserve.config import SchedulerConfig
from llmserve.contracts import FinishReason, ModelRunnerOutput, SchedulerOutput
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from llmserve.scheduling.request import RequestStatus
from llmserve.scheduling.scheduler import Scheduler
from tests.scheduling.fake_requests import make_request


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **config: Any) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size), max_model_len=4096)


def fake_run(output: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """Sample `token` for every request whose scheduled tokens reach its end, as the runner does."""
    return ModelRunnerOutput({s.request_id: [token] for s in output.scheduled if s.samples})


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update_from_output(output, fake_run(output))
    return output


def test_chunked_prefill_then_decode_mixed_in_one_batch() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("long", 25))
    scheduler.add_request(make_request("short", 3))
    first = step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in first.scheduled] == [("long", 10)]
    second = step(scheduler)
    assert [(s.request_id, s.num_new_tokens) for s in second.scheduled] == [("long", 10)]
    third = step(scheduler)  # the last 5 prompt tokens, and the short prompt fills the rest
    assert [(s.request_id, s.num_new_tokens) for s in third.scheduled] == [
        ("long", 5),
        ("short", 3),
    ]
    assert all(s.samples for s in third.scheduled)
    fourth = step(scheduler)  # both decode
    assert [(s.request_id, s.num_new_tokens) for s in fourth.scheduled] == [
        ("long", 1),
        ("short", 1),
    ]


def test_max_num_seqs_caps_the_running_set() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(str(i), 4))
    output = step(scheduler)
    assert [s.request_id for s in output.scheduled] == ["0", "1"]
    assert len(scheduler.waiting) == 1


def test_requests_finish_at_max_tokens_and_free_every_block() -> None:
    scheduler = make_scheduler()
    for i in range(5):
        scheduler.add_request(make_request(str(i), 3 + i, max_tokens=2 + i))
    finished: dict[str, FinishReason | None] = {}
    generated = dict.fromkeys(map(str, range(5)), 0)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        for out in scheduler.update_from_output(output, fake_run(output)):
            assert out.request_id not in finished, "no output after a request's last"
            generated[out.request_id] += len(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
    # ignore_eos and no stop tokens: every request ends on its length, with exactly max_tokens tokens
    assert finished == dict.fromkeys(map(str, range(5)), FinishReason.LENGTH)
    assert generated == {str(i): 2 + i for i in range(5)}
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_preempts_newest_when_blocks_run_out_and_recomputes_it() -> None:
    # 4 blocks of 4 tokens: two requests of 7 prompt tokens take 2 blocks each; the first to need a
    # third block forces the newest out.
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    old, new = make_request("old", 7, max_tokens=6), make_request("new", 7, max_tokens=6)
    scheduler.add_request(old)
    scheduler.add_request(new)
    step(scheduler)  # both prefill, each samples token 8
    step(scheduler)  # token 9 of each fits in block 1 (positions 7)
    output = step(scheduler)  # old needs block 2 for position 8: new is preempted
    assert [s.request_id for s in output.scheduled] == ["old"]
    assert new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 2
    assert scheduler.waiting.peek() is new
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert old.num_output_tokens == 6 and new.num_output_tokens == 6
    assert scheduler.num_preemptions >= 1
    assert scheduler.kv_cache_manager.num_free_blocks == 4


def test_abort_frees_blocks_of_running_and_waiting_requests() -> None:
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    scheduler.add_request(make_request("run", 8))
    scheduler.add_request(make_request("wait", 8))
    step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    done = scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert done == ["run", "wait"]
    assert scheduler.kv_cache_manager.num_free_blocks == 8
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_request_ids == ["run", "wait"]
