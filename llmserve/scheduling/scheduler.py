"""Continuous batching: which requests run this step, and how many of their tokens."""

from __future__ import annotations

import bisect
import time
import weakref
from collections import deque
from collections.abc import Callable

from llmserve.config import SchedulerConfig
from llmserve.contracts import (
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from llmserve.scheduling.request import Request, RequestStatus
from llmserve.scheduling.request_queue import RequestQueue, make_request_queue
from llmserve.spec_decode.speculator import Speculator


def _new_request_data(request: Request) -> NewRequestData:
    """What the model runner keeps of a request it sees for the first time, or again after a preemption."""
    return NewRequestData(
        request.request_id,
        request.prompt_token_ids,
        request.sampling_params,
        request.eos_token_id,
        request.bad_words_token_ids,
        request.pooling_params,
        request.output_token_ids,
        request.num_prompt_logprobs,
    )


def _rank(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then earlier arrivals."""
    return request.priority, request.arrival_time


class Scheduler:
    """vLLM v1's scheme: no separate prefill and decode phases, only `num_computed_tokens` catching up
    with `num_tokens`. Running requests go first; new ones are admitted in the waiting queue's order
    while the token budget, `max_num_seqs` and the KV pool allow. When blocks run out, the last running
    request is preempted: its blocks are freed and it recomputes later, ahead of later arrivals.

    Under fcfs, `running` is in admission order (the newest is preempted); under the priority policy it
    is kept in `_rank` order, so the victim is the request of the largest (priority, arrival), as in
    vLLM v1. With `max_queue_time`, a request never scheduled within that many seconds of reaching
    the scheduler ends with `FinishReason.QUEUE_TIMEOUT`. A request whose grammar is still compiling
    (`WAITING_FOR_FSM`) keeps its place in the queue while later ones are admitted past it; one whose
    grammar failed ends with `FinishReason.ERROR`. `clock` is for tests.

    With a `speculator`, a running request with one token left to compute may have it checked with
    guesses of the tokens after it (spec_decode/), once every request of the step has its tokens and
    only where the rest of the budget and free blocks have room: guesses never preempt a request nor
    keep one waiting.

    Without `chunked_prefill` (encoders, whole-prompt pooling) a prompt is admitted only whole, in a
    step with room for all of it; the engine core makes sure the longest fits an empty step. A pooling
    request finishes in the step that completes its prompt, and frees its blocks there.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        chunked_prefill: bool = True,
        speculator: Speculator | None = None,
    ):
        self.config = config
        self.speculator = speculator
        self.chunked_prefill = chunked_prefill
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = make_request_queue(config.scheduling_policy)
        self.running: list[Request] = []
        self._by_priority = config.scheduling_policy == "priority"
        self._clock = clock
        # (deadline, request) in arrival order, so deadlines ascend; an entry outlives its request's
        # admission until its deadline passes, by a weak reference that does not keep a finished
        # request (its tokens, its grammar matcher) alive
        self._queue_deadlines: deque[tuple[float, weakref.ref[Request]]] = deque()
        self._finished_unrun: list[EngineCoreOutput] = []  # ended in schedule(); sent with the next update
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if self.config.max_queue_time is not None:
            self._queue_deadlines.append((self._clock() + self.config.max_queue_time, weakref.ref(request)))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        if self._queue_deadlines:
            self._expire_waiting()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        new_requests: list[NewRequestData] = []  # admitted from the queue: new, or resumed
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
        num_running_scheduled = len(scheduled)

        # Admitting new work right after a preemption would only thrash the pool.
        compiling: list[Request] = []  # passed by: their grammars are not ready
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()  # new or preempted: nothing computed
            if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(request):
                if not request.status.finished:
                    compiling.append(self.waiting.pop())
                continue
            computed = self.kv_cache_manager.get_computed_blocks(request)
            num_cached = len(computed) * self.kv_cache_manager.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.chunked_prefill and num_new < request.num_tokens - num_cached:
                break  # whole, in a later step
            if not self.kv_cache_manager.allocate_slots(request, num_new, computed):
                break
            request.num_computed_tokens = num_cached
            self.waiting.pop()
            request.status = RequestStatus.RUNNING
            if self._by_priority:
                bisect.insort(self.running, request, key=_rank)
            else:
                self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            new_requests.append(_new_request_data(request))
            budget -= num_new
        for request in reversed(compiling):
            self.waiting.prepend(request)
        if self.speculator is not None and self.speculator.speculates(len(self.running)):
            self._add_guesses(scheduled[:num_running_scheduled], budget)

        out = SchedulerOutput(scheduled, new_requests, self._finished_ids)
        self._finished_ids = []
        return out

    def _expire_waiting(self) -> None:
        """Requests past their deadline that were never scheduled finish unrun (they hold no blocks)."""
        now = self._clock()
        expired: list[Request] = []
        while self._queue_deadlines and self._queue_deadlines[0][0] <= now:
            request = self._queue_deadlines.popleft()[1]()
            queued = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM)
            if request is not None and request.status in queued:
                expired.append(request)
        if not expired:
            return
        self.waiting.remove(set(expired))
        for request in expired:
            request.status = RequestStatus.FINISHED_QUEUE_TIMEOUT
            self._free_finished(request)
            self._finished_unrun.append(EngineCoreOutput(request.request_id, [], FinishReason.QUEUE_TIMEOUT))

    def _grammar_ready(self, request: Request) -> bool:
        """Whether the request's grammar compiled; one that failed to finishes the request (ERROR).
        Any exception of the compile (the tokenizer's loading too) fails only this request."""
        assert request.structured_output is not None
        try:
            ready = request.structured_output.is_ready()
        except Exception as e:
            self.waiting.pop()
            self._finished_unrun.append(self._fail(request, f"structured_outputs failed to compile: {e}"))
            return False
        if ready:
            request.status = RequestStatus.WAITING
        return ready

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request.request_id,
            start,
            request.all_token_ids[start : start + num_new],
            self.kv_cache_manager.get_block_ids(request.request_id),
            samples=start + num_new == request.num_tokens,
        )

    def _add_guesses(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        """Guesses checked after the last token of the running requests that decode this step, from
        what the step left: its token budget, the free blocks and the room in the requests' own last
        blocks, so that they never preempt a request nor keep one waiting."""
        assert self.speculator is not None
        for sched in scheduled:
            if budget <= 0:
                return
            request = self.requests[sched.request_id]
            if sched.num_new_tokens != 1 or not sched.samples:
                continue
            guesses = self.speculator.propose(request, budget)
            if guesses and not self.kv_cache_manager.allocate_slots(request, 1 + len(guesses)):
                held = len(sched.block_ids) * self.kv_cache_manager.block_size
                guesses = guesses[: max(held - request.num_computed_tokens - 1, 0)]  # those its blocks fit
            if guesses:
                sched.spec_token_ids = guesses
                sched.block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
                budget -= len(guesses)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance every scheduled request; append sampled tokens; finish those that stop. The
        outputs start with those of the requests `schedule()` ended unrun (expired, grammar failed)."""
        outputs, self._finished_unrun = self._finished_unrun, []
        for sched in scheduler_output.scheduled:
            request = self.requests.get(sched.request_id)
            if request is None:  # aborted while the step ran
                continue
            num_drafts = len(sched.spec_token_ids)
            request.num_computed_tokens += sched.num_new_tokens - num_drafts
            self.kv_cache_manager.cache_full_blocks(request)
            prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
            if prompt_logprobs:
                request.add_prompt_logprobs(prompt_logprobs)
            pooled = runner_output.pooled.get(request.request_id)
            if pooled is not None:
                request.status = RequestStatus.FINISHED_STOPPED
                self._free_finished(request)
                output = EngineCoreOutput(request.request_id, [], FinishReason.STOP, pooling_output=pooled)
                outputs.append(output)
                continue
            tokens = runner_output.sampled_token_ids.get(request.request_id)
            if tokens is None:
                continue
            if num_drafts:
                assert self.speculator is not None
                self.speculator.record(request, num_drafts, len(tokens) - 1)
            outputs.append(
                self._append_tokens(request, tokens, runner_output.logprobs.get(request.request_id))
            )
        return outputs

    def _append_tokens(
        self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None
    ) -> EngineCoreOutput:
        """Append a step's sampled tokens one by one, as if each had its own step: the grammar accepts
        each, and the first that stops the request drops those after it. Every one but the last is a
        confirmed guess, whose row computed its KV."""
        grammar = request.structured_output.grammar if request.structured_output else None
        kept: list[int] = []
        for token in tokens:
            request.append_output_token(token)
            kept.append(token)
            if grammar is not None and not grammar.accept_tokens([token]):
                return self._fail(request, f"structured_outputs rejected token {token}: {grammar.error}")
            if request.check_stop():
                break
        if len(kept) > 1:
            request.num_computed_tokens += len(kept) - 1
            self.kv_cache_manager.cache_full_blocks(request)
        if request.status.finished:
            self._free_finished(request)
        return EngineCoreOutput(
            request.request_id,
            kept,
            request.status.finish_reason,
            request.stop_reason,
            None if logprobs is None else logprobs[: len(kept)],
            request.take_prompt_logprobs(),
        )

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[str]:
        """Finish (abort) requests wherever they are; unknown or finished ids are ignored."""
        found = [r for r in map(self.requests.get, dict.fromkeys(request_ids)) if r is not None]
        queued = {r for r in found if r.status != RequestStatus.RUNNING}
        if queued:
            self.waiting.remove(queued)
        for request in found:
            request.status = status
            self._free_finished(request)
        return [r.request_id for r in found]

    def _fail(self, request: Request, message: str) -> EngineCoreOutput:
        request.status = RequestStatus.FINISHED_ERROR
        self._free_finished(request)
        return EngineCoreOutput(request.request_id, [], FinishReason.ERROR, error=message)

    def _free_finished(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        if self.speculator is not None:
            self.speculator.free(request.request_id)
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
            spec_decoding=None if self.speculator is None else self.speculator.snapshot(),
        )
