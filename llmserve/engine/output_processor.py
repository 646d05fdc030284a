"""`EngineCoreOutputs` → `RequestOutput`s: detokenize, apply stop strings, honour the output kind."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from llmserve.engine.detokenizer import IncrementalDetokenizer
from llmserve.engine.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs
from llmserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SampleLogprobs
from llmserve.sampling_params import RequestOutputKind


class RequestState:
    """Everything the front end tracks for one request between its outputs."""

    def __init__(
        self, request: EngineCoreRequest, prompt: str | None, tokenizer: PreTrainedTokenizerBase
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = params.output_kind
        self.stop_strings = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        # While a stop string may still be completing, its first characters are not shown yet.
        longest = max((len(s) for s in self.stop_strings), default=0)
        self.hold_back = 0 if self.include_stop else max(longest - 1, 0)
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = None if params.logprobs is None else []
        self.cumulative_logprob = 0.0
        self.tokenizer = tokenizer
        self.text = ""
        self.sent_tokens = 0
        self.sent_chars = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)

    def update(self, output: EngineCoreOutput, now: float) -> bool:
        """Absorb one core output. Returns True if a stop string ended the request here."""
        if self.metrics.first_token_time is None and output.new_token_ids:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.token_ids.extend(output.new_token_ids)
        if self.logprobs is not None and output.new_logprobs:
            self._add_logprobs(output.new_logprobs)
        previous_len = len(self.text)
        self.text += self.detokenizer.decode(output.new_token_ids)
        self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        stopped = self._check_stop_strings(previous_len)
        if self.finish_reason is not None:
            self.metrics.finished_time = now
        return stopped

    def _add_logprobs(self, entries: list[TokenLogprobs]) -> None:
        assert self.logprobs is not None
        for entry in entries:
            self.cumulative_logprob += entry.logprobs[0]
            self.logprobs.append(
                {
                    token: Logprob(lp, rank, str(self.tokenizer.decode([token])))
                    for token, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)
                }
            )

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

    def make_output(self) -> RequestOutput | None:
        """The output to deliver now, or None when the output kind says to wait."""
        finished = self.finish_reason is not None
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        visible = len(self.text) if finished else max(len(self.text) - self.hold_back, 0)
        if self.output_kind == RequestOutputKind.DELTA:
            text = self.text[self.sent_chars : visible]
            token_ids = self.token_ids[self.sent_tokens :]
            logprobs = None if self.logprobs is None else self.logprobs[self.sent_tokens :]
            if not text and not token_ids and not finished:
                return None
            self.sent_chars = max(self.sent_chars, visible)
            self.sent_tokens = len(self.token_ids)
        else:
            text, token_ids = self.text[:visible], list(self.token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=None if self.logprobs is None else self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(self.finish_reason) if finished else None,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=self.metrics,
        )


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Requests a stop string finished here that the core still runs: the caller must abort them.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"Request id {request.request_id!r} is already in use.")
        self.request_states[request.request_id] = RequestState(request, prompt, self.tokenizer)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.request_states.pop(request_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        result = OutputProcessorOutput()
        now = time.monotonic()
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:  # aborted meanwhile
                continue
            core_finished = output.finished
            stopped_by_string = state.update(output, now)
            request_output = state.make_output()
            if request_output is not None:
                result.request_outputs.append(request_output)
            if state.finish_reason is not None:
                del self.request_states[output.request_id]
                if stopped_by_string and not core_finished:
                    result.reqs_to_abort.append(output.request_id)
        return result
