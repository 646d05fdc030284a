"""Continuous batching: which requests run this step, and how many of their tokens."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmserve.config import SchedulerConfig
from llmserve.engine.messages import EngineCoreOutput, SchedulerStats, TokenLogprobs
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from llmserve.scheduling.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """`num_new_tokens` of `request`, starting at its `num_computed_tokens`, run this step.

    `samples` says whether they reach the end of the request's tokens, so a new token is sampled.
    """

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    samples: bool


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # since the last step

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    """The token sampled for each request whose scheduled tokens reached its end, and its logprobs
    for the requests that asked; for those that asked for prompt logprobs, the prompt positions this
    step scored for the first time."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class Scheduler:
    """vLLM v1's scheme: no separate prefill and decode phases, only `num_computed_tokens` catching up
    with `num_tokens`. Running requests go first (oldest first); new ones are admitted while the token
    budget, `max_num_seqs` and the KV pool allow. When blocks run out, the newest running request is
    preempted: its blocks are freed and it recomputes later from the front of the waiting queue.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1
                continue
            break

        # Admitting new work right after a preemption would only thrash the pool.
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]  # new or preempted: nothing computed
            computed = self.kv_cache_manager.get_computed_blocks(request)
            num_cached = len(computed) * self.kv_cache_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv_cache_manager.allocate_slots(request, num_new, computed):
                break
            request.num_computed_tokens = num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        out = SchedulerOutput(scheduled, self._finished_ids)
        self._finished_ids = []
        return out

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(
            request,
            num_new,
            self.kv_cache_manager.get_block_ids(request.request_id),
            samples=request.num_computed_tokens + num_new == request.num_tokens,
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance every scheduled request; append sampled tokens; finish those that stop."""
        outputs: list[EngineCoreOutput] = []
        for sched in scheduler_output.scheduled:
            request = sched.request
            if request.status.finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += sched.num_new_tokens
            self.kv_cache_manager.cache_full_blocks(request)
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
            if prompt_logprobs:
                request.add_prompt_logprobs(prompt_logprobs)
            token = runner_output.sampled_token_ids.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token)
            if request.check_stop():
                self._free_finished(request)
            logprobs = runner_output.logprobs.get(request.request_id)
            outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    [token],
                    request.status.finish_reason,
                    request.stop_reason,
                    None if logprobs is None else [logprobs],
                    request.take_prompt_logprobs(),
                )
            )
        return outputs

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[str]:
        """Finish (abort) requests wherever they are; unknown or finished ids are ignored."""
        done = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_finished(request)
            done.append(request_id)
        return done

    def _free_finished(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_preemptions=self.num_preemptions,
            num_requests=len(self.requests),
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_total_blocks=self.kv_cache_manager.block_pool.num_blocks,
            prefix_cache_queries=self.kv_cache_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache_manager.prefix_cache_hits,
        )
