"""The engine core's view of one request: its tokens, how many have KV computed, and its state."""

from __future__ import annotations

import enum

from llmserve.contracts import EngineCoreRequest, FinishReason, TokenLogprobs
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams
from llmserve.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_FSM = 1  # waiting, and its grammar is still compiling: the scheduler passes it by
    RUNNING = 2
    PREEMPTED = 3  # back in the waiting queue, KV freed; recomputes prompt + output so far
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_QUEUE_TIMEOUT = 7  # never scheduled within max_queue_time
    FINISHED_ERROR = 8  # its grammar failed to compile or rejected a token

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_QUEUE_TIMEOUT: FinishReason.QUEUE_TIMEOUT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Invariant: `num_computed_tokens <= num_tokens`; tokens past it still need a forward pass.

    With prompt logprobs, `num_prompt_logprobs` counts the prompt positions already scored (hidden
    state i scores prompt token i + 1), so a recompute after preemption does not score them again;
    `prompt_logprobs` holds those not yet sent, until the first output carries them.

    With structured outputs, `structured_output.grammar` has accepted exactly the output tokens: a
    preempted request keeps them (it recomputes their KV), so its matcher stays as it is.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float,
        max_model_len: int,
        bad_words_token_ids: list[list[int]] | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.cache_salt = cache_salt  # enters its first KV block's hash: it shares blocks only with its salt
        self.pooling_params = pooling_params  # a pooling request: its prompt only, then its vector
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.structured_output = (
            None
            if sampling_params.structured_outputs is None
            else StructuredOutputRequest(sampling_params.structured_outputs)
        )
        self.status = (
            RequestStatus.WAITING if self.structured_output is None else RequestStatus.WAITING_FOR_FSM
        )
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        room = max_model_len - self.num_prompt_tokens
        requested = sampling_params.max_tokens
        self.max_tokens = room if requested is None else min(requested, room)
        self._stop_token_ids = frozenset(sampling_params.stop_token_ids or ())
        self.bad_words_token_ids = bad_words_token_ids
        self.num_prompt_logprobs = 0
        self.prompt_logprobs: list[TokenLogprobs] = []

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_id,
            req.arrival_time,
            max_model_len,
            req.bad_words_token_ids,
            req.priority,
            req.pooling_params,
            req.cache_salt,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def add_prompt_logprobs(self, entries: list[TokenLogprobs]) -> None:
        self.prompt_logprobs.extend(entries)
        self.num_prompt_logprobs += len(entries)

    def take_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """The prompt logprobs not yet sent (None if there are none), now counted as sent."""
        if not self.prompt_logprobs:
            return None
        entries, self.prompt_logprobs = self.prompt_logprobs, []
        return entries

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """After a token was appended: set the finished status if this token ends the request."""
        last = self.all_token_ids[-1]
        if self.num_output_tokens >= self.sampling_params.min_tokens:
            if last == self.eos_token_id and not self.sampling_params.ignore_eos:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in self._stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        grammar = self.structured_output.grammar if self.structured_output is not None else None
        if grammar is not None and grammar.is_terminated():  # complete: nothing but EOS could follow
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
