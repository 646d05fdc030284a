"""The only contract between the front end and the engine core: msgspec structs, cheap to encode.

A request crosses once (`EngineCoreRequest`); every step sends back one `EngineCoreOutputs` holding the
new tokens of each request that advanced, and which requests finished and why.
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


# The wire between the front end and the engine core process. Every ZMQ message has two frames: a
# one-byte type and a msgpack payload. Only these types cross; nothing is pickled.


class EngineCoreRequestType(enum.Enum):
    """Front end → core. The payload type is named on each member."""

    ADD = b"\x00"  # EngineCoreRequest
    ABORT = b"\x01"  # list[str]: request ids
    UTILITY = b"\x02"  # UtilityCall
    SHUTDOWN = b"\x03"  # nothing (an empty payload)


# The longest the core stays silent once READY: its output thread sends a HEARTBEAT after this long
# without a message. Shorter detects a hung core sooner; each beat wakes an idle front end once.
HEARTBEAT_INTERVAL_S = 0.5


class EngineCoreEventType(enum.Enum):
    """Core → front end. READY or STARTUP_FAILED comes first and once; ERROR comes last. After READY,
    HEARTBEAT comes whenever nothing else was sent for `HEARTBEAT_INTERVAL_S`, from a thread that a long
    step does not block: a core that sends nothing at all is stopped or wedged, not busy."""

    READY = b"\x00"  # ResolvedLimits
    STARTUP_FAILED = b"\x01"  # EngineCoreFailure; the process then exits
    OUTPUTS = b"\x02"  # EngineCoreOutputs
    UTILITY_RESULT = b"\x03"  # UtilityResult
    ERROR = b"\x04"  # EngineCoreFailure from the busy loop; the process then exits
    HEARTBEAT = b"\x05"  # nothing (msgpack nil)


class UtilityCall(msgspec.Struct, array_like=True):
    """Run `method` (a name the core publishes, such as "get_scheduler_stats") between two steps."""

    call_id: int
    method: str


class UtilityResult(msgspec.Struct, array_like=True):
    """The answer to the `UtilityCall` of the same id; `result` is msgpack the caller decodes."""

    call_id: int
    result: msgspec.Raw


class EngineCoreFailure(msgspec.Struct, array_like=True):
    """Why the core could not start, or why its busy loop stopped. `is_value_error` marks a bad
    configuration (the front end raises `ValueError` with `message`)."""

    error_type: str
    message: str
    is_value_error: bool = False
