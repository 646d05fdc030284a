"""`n > 1`: one user request fanned out into n child requests, whose outputs are gathered back."""

from __future__ import annotations

import msgspec

from llmserve.contracts import EngineCoreRequest
from llmserve.engine.input_processor import InputProcessor, PromptType
from llmserve.outputs import CompletionOutput
from llmserve.sampling_params import INT64_MIN, RequestOutputKind, SamplingParams


class ParentRequest:
    """Children get distinct ids (`{i}_{request_id}`) and, with a seed, seeds `seed + i` (wrapped
    into int64, so a valid seed never makes a child the engine cannot take), so the n samples differ
    yet are reproducible. FINAL_ONLY gathers all n completions into one output;
    the other kinds forward each child's progress as it comes (with the child's `index`).
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.n = params.n
        self.output_kind = params.output_kind
        self.child_params = [
            params.clone(n=1, seed=None if params.seed is None else _wrap_int64(params.seed + i))
            for i in range(self.n)
        ]
        self.child_ids = [f"{i}_{request_id}" for i in range(self.n)]
        self._unfinished = set(self.child_ids)
        self._completions: list[CompletionOutput | None] = [None] * self.n

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def gather(self, child_id: str, completion: CompletionOutput) -> list[CompletionOutput] | None:
        """The completions to deliver for this child's output, or None to wait for the others."""
        if completion.finished():
            self._unfinished.discard(child_id)
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            return [completion]
        self._completions[completion.index] = completion
        if not self.finished:
            return None
        return [c for c in self._completions if c is not None]


def _wrap_int64(value: int) -> int:
    return (value - INT64_MIN) % 2**64 + INT64_MIN


def fan_out(
    processor: InputProcessor,
    request_id: str,
    prompt: PromptType,
    params: SamplingParams,
    arrival_time: float | None = None,
    priority: int = 0,
) -> tuple[str | None, ParentRequest | None, list[EngineCoreRequest]]:
    """Validate and tokenize once; returns the prompt text, the parent (n > 1 only) and the core
    requests to submit (the children, or the request itself)."""
    request, text = processor.process_inputs(request_id, prompt, params, arrival_time, priority)
    if params.n == 1:
        return text, None, [request]
    parent = ParentRequest(request_id, request.sampling_params)
    children = [
        msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
        for child_id, child_params in zip(parent.child_ids, parent.child_params)
    ]
    return text, parent, children
