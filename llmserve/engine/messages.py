"""The only contract between the front end and the engine core: msgspec structs, cheap to encode.

A request crosses once (`EngineCoreRequest`); every step sends back one `EngineCoreOutputs` holding the
new tokens of each request that advanced, and which requests finished and why.
"""

from __future__ import annotations

import enum

import msgspec

from llmserve.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the caller

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request. `eos_token_id` is None when the model has none."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Raw model logprobs at one position: the chosen token first, then the top-k by rank.

    `ranks[0]` is the chosen token's rank (1 = most likely); the top-k ranks are 1..k.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request. `stop_reason` is the stop token id, if any.

    `new_logprobs` has one entry per new token when the request asked for logprobs.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    new_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """A snapshot of the core after one step, for stats logging and /metrics."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
