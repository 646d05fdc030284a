"""`EngineCoreOutputs` → `RequestOutput`s: detokenize, apply stop strings, honour the output kind."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from llmserve.contracts import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs
from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.parallel_sampling import ParentRequest
from llmserve.engine.pooling_state import PoolingRequestState
from llmserve.metrics.stats import FinishedRequestStats, IterationStats
from llmserve.outputs import (
    AnyRequestOutput,
    CompletionOutput,
    Logprob,
    OutputSink,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from llmserve.sampling_params import RequestOutputKind


class RequestState:
    """Everything the front end tracks for one (child) request between its outputs."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer: PreTrainedTokenizerBase,
        parent: ParentRequest | None,
        index: int,
        sink: OutputSink | None,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.parent = parent
        self.index = index
        self.sink = sink
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = params.output_kind
        self.stop_strings = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        # While a stop string may still be completing, its first characters are not shown yet.
        longest = max((len(s) for s in self.stop_strings), default=0)
        self.hold_back = 0 if self.include_stop else max(longest - 1, 0)
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = None if params.logprobs is None else []
        self.prompt_logprobs: PromptLogprobs | None = None if params.prompt_logprobs is None else [None]
        self.prompt_logprobs_sent = False
        self.cumulative_logprob = 0.0
        self.text = ""
        self.sent_tokens = 0
        self.sent_chars = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)

    @property
    def external_id(self) -> str:
        return self.request_id if self.parent is None else self.parent.request_id

    def update(self, output: EngineCoreOutput, now: float, stats: IterationStats) -> bool:
        """Absorb one core output. Returns True if a stop string ended the request here."""
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            stats.num_prompt_tokens += len(self.prompt_token_ids)
            stats.time_to_first_tokens.append(now - m.arrival_time)
        elif m.last_token_time is not None:
            stats.inter_token_latencies.append(now - m.last_token_time)
        m.last_token_time = now
        self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        new_token_ids, stopped = self._detokenize(output.new_token_ids)
        stats.num_generation_tokens += len(new_token_ids)
        self.token_ids.extend(new_token_ids)
        if self.logprobs is not None and output.new_logprobs:
            new_logprobs = output.new_logprobs[: len(new_token_ids)]
            for entry in new_logprobs:
                self.cumulative_logprob += entry.logprobs[0]
            self.logprobs.extend(self._logprob_dicts(new_logprobs))
        if self.prompt_logprobs is not None and output.new_prompt_logprobs:
            self.prompt_logprobs.extend(self._logprob_dicts(output.new_prompt_logprobs))
        if self.finish_reason is not None:
            m.finished_time = now
            stats.finished_requests.append(
                FinishedRequestStats(
                    str(self.finish_reason),
                    now - m.arrival_time,
                    len(self.prompt_token_ids),
                    len(self.token_ids),
                )
            )
        return stopped

    def _detokenize(self, token_ids: list[int]) -> tuple[list[int], bool]:
        """Add the tokens' text. With stop strings, token by token: one output may carry several
        tokens (confirmed guesses), and the first token that completes a stop string ends the request
        there, as it would have in a step of its own. Returns the tokens kept, and whether a stop string
        ended the request."""
        if not self.stop_strings:
            self.text += self.detokenizer.decode(token_ids)
            return token_ids, False
        for i, token_id in enumerate(token_ids):
            previous_len = len(self.text)
            self.text += self.detokenizer.decode([token_id])
            if self._check_stop_strings(previous_len):
                return token_ids[: i + 1], True
        return token_ids, False

    def _logprob_dicts(self, entries: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        """One {token: Logprob} per position, every token's text decoded in one call."""
        unique = list(dict.fromkeys(t for e in entries for t in e.token_ids))
        texts = dict(zip(unique, self.tokenizer.batch_decode([[t] for t in unique])))
        return [
            {
                token: Logprob(lp, rank, texts[token])
                for token, lp, rank in zip(e.token_ids, e.logprobs, e.ranks)
            }
            for e in entries
        ]

    def _check_stop_strings(self, previous_len: int) -> bool:
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            index = self.text.find(stop, max(0, previous_len - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        self.finish_reason, self.stop_reason = FinishReason.STOP, stop
        return True

    def make_completion(self) -> CompletionOutput | None:
        """The completion to deliver now, or None when the output kind says to wait."""
        finished = self.finish_reason is not None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        visible = len(self.text) if finished else max(len(self.text) - self.hold_back, 0)
        logprobs = self.logprobs
        if self.output_kind == RequestOutputKind.DELTA:
            text = self.text[self.sent_chars : visible]
            token_ids = self.token_ids[self.sent_tokens :]
            logprobs = None if logprobs is None else logprobs[self.sent_tokens :]
            if not text and not token_ids and not finished:
                return None
            self.sent_chars = max(self.sent_chars, visible)
            self.sent_tokens = len(self.token_ids)
        else:
            text, token_ids = self.text[:visible], list(self.token_ids)
            logprobs = None if logprobs is None else list(logprobs)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=None if self.logprobs is None else self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(self.finish_reason) if finished else None,
            stop_reason=self.stop_reason,
        )

    def make_output(self) -> RequestOutput | None:
        completion = self.make_completion()
        if completion is None:
            return None
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind == RequestOutputKind.DELTA:  # given once, with the first output
            prompt_logprobs = None if self.prompt_logprobs_sent else prompt_logprobs
            self.prompt_logprobs_sent = True
        completions: list[CompletionOutput] | None = [completion]
        finished = completion.finished()
        if self.parent is not None:
            completions = self.parent.gather(self.request_id, completion)
            finished = self.parent.finished
        if completions is None:
            return None
        return RequestOutput(
            request_id=self.external_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=self.metrics,
            prompt_logprobs=prompt_logprobs,
        )


@dataclass
class OutputProcessorOutput:
    # Outputs of requests without a sink (the sync engine returns them from `step()`).
    request_outputs: list[AnyRequestOutput] = field(default_factory=list)
    # Requests a stop string finished here that the core still runs: the caller must abort them.
    reqs_to_abort: list[str] = field(default_factory=list)
    stats: IterationStats = field(default_factory=IterationStats)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState | PoolingRequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        index: int = 0,
        sink: OutputSink | None = None,
    ) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.request_states[request.request_id] = (
            RequestState(request, prompt, self.tokenizer, parent, index, sink)
            if request.pooling_params is None
            else PoolingRequestState(request, sink)
        )
        if parent is not None:
            self.parents[parent.request_id] = parent

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def core_request_ids(self, request_ids: list[str]) -> list[str]:
        """The ids the core knows for these user ids (a parent's children, or the id itself)."""
        out: list[str] = []
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            out.extend(parent.child_ids if parent is not None else [request_id])
        return out

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget these user requests; returns the core ids to abort."""
        core_ids = self.core_request_ids(request_ids)
        for request_id in core_ids:
            self.request_states.pop(request_id, None)
        for request_id in request_ids:
            self.parents.pop(request_id, None)
        return core_ids

    def propagate_error(self, error: BaseException) -> None:
        """The engine died: every waiting request gets the error."""
        for state in self.request_states.values():
            if state.sink is not None:
                state.sink.put(error)
        self.request_states.clear()
        self.parents.clear()

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        result = OutputProcessorOutput()
        now = time.monotonic()
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:  # aborted meanwhile
                continue
            stopped_by_string = state.update(output, now, result.stats)
            request_output = state.make_output()
            if request_output is not None:
                if state.sink is not None:
                    state.sink.put(request_output)
                else:
                    result.request_outputs.append(request_output)
            if state.finish_reason is not None:
                del self.request_states[output.request_id]
                if state.parent is not None and state.parent.finished:
                    self.parents.pop(state.parent.request_id, None)
                if stopped_by_string and not output.finished:
                    result.reqs_to_abort.append(output.request_id)
        return result
