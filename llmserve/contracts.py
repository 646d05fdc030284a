"""The types that cross the layers: front end ↔ engine core, scheduler → model runner → scheduler.

Everything here is data (msgspec structs, cheap to encode) and this module imports nothing of ours above
the parameter classes, so every layer can depend on it. A request crosses to the core once
(`EngineCoreRequest`); every step sends back one `EngineCoreOutputs` holding the new tokens of each
request that advanced, and which requests finished and why. Inside the core the scheduler tells the model
runner what to compute as data too (`SchedulerOutput`: a request's parameters the first time it runs,
then ids, token ids, positions and block ids), vLLM v1's split, so that the runner could live in another
process; the runner answers with `ModelRunnerOutput`.
"""

from __future__ import annotations

import enum

import msgspec

from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the caller
    QUEUE_TIMEOUT = 3  # waited longer than max_queue_time to be scheduled; nothing was generated
    ERROR = 4  # the request failed in the core (its grammar did not compile or rejected a token)
    RANK_DIED = 5  # set by the front end only: the data-parallel rank that held the request died

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A validated, tokenized request. `eos_token_id` is None when the model has none.

    `bad_words_token_ids` holds the token sequences of `sampling_params.bad_words`, tokenized by the
    front end (the core has no tokenizer). `priority` orders the waiting queue under the priority
    scheduling policy (lower first); under fcfs the front end only lets 0 through.

    With `pooling_params` it is a pooling request, for an engine of the pooling runner: the core
    computes its prompt and returns the pooled hidden state (`EngineCoreOutput.pooling_output`) once,
    generating nothing; its `sampling_params` are then never read.

    `cache_salt` (vLLM's, a non-empty string) enters the hash of the request's first KV block, so only
    requests with the same salt share prefix-cached blocks (one tenant never reads another's).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    bad_words_token_ids: list[list[int]] | None = None
    priority: int = 0
    pooling_params: PoolingParams | None = None
    data_parallel_rank: int | None = None  # the rank that must serve it (vLLM's); None: the least loaded
    cache_salt: str | None = None


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
    `new_prompt_logprobs` comes once, with the first output of a request that asked for prompt
    logprobs: one entry per prompt token after the first, the prompt token in place of the sampled one.
    `error` says why, with `FinishReason.ERROR`. A pooling request's only output carries its vector
    in `pooling_output` (float32, little-endian bytes), with `FinishReason.STOP`.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    pooling_output: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Speculative decoding's totals since the core started, as vLLM counts them: `num_drafts` checked
    steps of `num_draft_tokens` guessed tokens, `num_accepted_tokens` of them confirmed; per guess
    position, how many were (position i only where the i before it were)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """A snapshot of the core after one step, for stats logging and /metrics."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_requests: int = 0  # every request the core holds: running, waiting or preempted
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # cumulative: prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # cumulative: of which found cached
    spec_decoding: SpecDecodingStats | None = None  # with a speculative config


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """`engine_index` is the data-parallel rank that sent them; the front end sets it on arrival."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    engine_index: int = 0


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the model runner keeps of a request, sent the first step it runs, and again when it resumes
    after a preemption (`output_token_ids` then holds what it generated, `num_prompt_logprobs` the
    prompt positions already scored)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    bad_words_token_ids: list[list[int]] | None = None
    pooling_params: PoolingParams | None = None
    output_token_ids: list[int] = []
    num_prompt_logprobs: int = 0


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """The tokens of one request run this step: `token_ids` at positions from `num_computed_tokens`, then
    `spec_token_ids`, in the KV blocks `block_ids`.

    `samples` says whether they reach the end of the request's tokens, so a new token is sampled.
    `spec_token_ids` are guesses of the tokens after them, checked in the same step: every one of those
    rows samples, and the request keeps the guesses the samples confirm plus the first sample that
    differs, or the one after the last guess.
    """

    request_id: str
    num_computed_tokens: int
    token_ids: list[int]
    block_ids: list[int]
    samples: bool
    spec_token_ids: list[int] = []

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step: the requests the runner sees for the first time (or again, resumed), every request
    that runs and its tokens, and the requests finished since the last step (the runner drops them)."""

    scheduled: list[ScheduledRequest] = []
    new_requests: list[NewRequestData] = []
    finished_request_ids: list[str] = []

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """The tokens sampled for each request whose scheduled tokens reached its end (one, or with
    guesses the confirmed ones and one more), and their logprobs for the requests that asked; for those
    that asked for prompt logprobs, the prompt positions this step scored for the first time; for the
    pooling runner, each request whose prompt this step completed → its vector (float32 bytes)."""

    sampled_token_ids: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    pooled: dict[str, bytes] = {}
