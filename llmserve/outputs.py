"""What the user gets back: `RequestOutput` holding one `CompletionOutput` per sample, or for a pooling
request a `PoolingRequestOutput` holding its vector (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    """A token's raw model log-probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # one per prompt token; the first is None


@dataclass
class CompletionOutput:
    """One generated sequence. With DELTA output, `text` and `token_ids` hold only the new part."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of one request's life, for latency stats."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The output of one request so far; `finished` is True on the last one."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, other: RequestOutput, aggregate: bool) -> None:
        """Fold a later output of the same request into this one (when a consumer lags behind).

        With `aggregate` (DELTA outputs) texts, token ids and logprobs are concatenated per sample
        index; otherwise each sample is replaced by its newer version.
        """
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for new in other.outputs:
            i = by_index.get(new.index)
            if i is None:
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[i] = new
            else:
                old = self.outputs[i]
                old.text += new.text
                old.token_ids = old.token_ids + new.token_ids
                if new.logprobs is not None:
                    old.logprobs = (old.logprobs or []) + new.logprobs
                old.cumulative_logprob = new.cumulative_logprob
                old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = other.finished
        self.metrics = other.metrics or self.metrics


@dataclass
class PoolingOutput:
    """The pooled hidden state of one prompt: float32 [hidden_size] (or `dimensions`), normalised
    where the request or the model asked."""

    data: torch.Tensor


_O = TypeVar("_O")


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """The one output of a pooling request; `finished` is always True (nothing streams)."""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """What `LLM.embed` returns for each prompt."""

    @staticmethod
    def from_base(output: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            output.request_id,
            EmbeddingOutput(output.outputs.data.tolist()),
            output.prompt_token_ids,
            output.finished,
            output.num_cached_tokens,
        )


AnyRequestOutput = RequestOutput | PoolingRequestOutput[PoolingOutput]


class OutputSink(Protocol):
    """Where a request's outputs go in `AsyncLLM` (its `RequestOutputCollector`)."""

    def put(self, output: AnyRequestOutput | BaseException) -> None: ...
