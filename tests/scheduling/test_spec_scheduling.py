"""Where the scheduler puts guesses: after every request of the step has its tokens, never at the cost of
a preemption, a waiting request or another request's token."""

from __future__ import annotations

from llmserve.config import SchedulerConfig, SpeculativeConfig
from llmserve.contracts import ModelRunnerOutput
from llmserve.sampling_params import SamplingParams
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from llmserve.scheduling.request import Request
from llmserve.scheduling.scheduler import Scheduler
from llmserve.spec_decode.speculator import Speculator


def scheduler(num_blocks: int, budget: int = 2048) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=False)
    config = SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=3, disable_by_batch_size=8)
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget), kv, 4096, speculator=Speculator(config, 4096)
    ), kv


def request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=50), None, 0.0, 4096)


def test_guesses_take_only_blocks_left_free_and_never_preempt() -> None:
    s, kv = scheduler(num_blocks=4)
    s.add_request(request("a", [1, 2, 3, 4, 1, 2]))  # "1 2" recurs: a guesses 3 4 1
    s.add_request(request("b", [9, 8, 7, 6]))
    first = s.schedule()
    s.update_from_output(first, ModelRunnerOutput({"a": [3], "b": [5]}))
    # a's guesses would need a fourth block, which b's next token needs: b keeps it, a guesses less
    step = s.schedule()
    assert s.num_preemptions == 0 and kv.num_free_blocks == 0
    assert [(x.request_id, x.num_new_tokens - len(x.spec_token_ids)) for x in step.scheduled] == [
        ("a", 1),
        ("b", 1),
    ]
    assert [x.spec_token_ids for x in step.scheduled] == [[4], []]  # the room left in a's own block


def test_guesses_take_only_the_budget_left() -> None:
    s, _ = scheduler(num_blocks=64, budget=3)
    s.add_request(request("a", [1, 2, 3, 4, 1, 2]))
    s.add_request(request("b", [1, 2, 3, 4, 1, 2, 3]))
    s.add_request(request("c", [5]))
    first = s.schedule()  # a's 6 tokens take the whole first step's budget of 3, then the rest
    while not all(x.samples for x in first.scheduled) or len(first.scheduled) < 3:
        s.update_from_output(
            first, ModelRunnerOutput({x.request_id: [3] for x in first.scheduled if x.samples})
        )
        first = s.schedule()
    s.update_from_output(first, ModelRunnerOutput({x.request_id: [3] for x in first.scheduled}))
    step = s.schedule()
    assert [x.num_new_tokens for x in step.scheduled] == [1, 1, 1]  # no budget left for guesses
