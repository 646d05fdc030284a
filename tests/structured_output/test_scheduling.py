"""The scheduler with grammars: a request waits for its grammar without holding up the others, a grammar
that failed ends its request with an error, and each sampled token advances the matcher."""

from __future__ import annotations

from concurrent.futures import Future

from llmserve.contracts import FinishReason
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from llmserve.scheduling.request import Request, RequestStatus
from llmserve.structured_output.backend import Grammar
from tests.scheduling.test_scheduler import fake_run, make_scheduler, step


class CountingGrammar(Grammar):
    """Accepts `length` tokens of any kind, then is complete."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.accepted: list[int] = []

    def accept_tokens(self, tokens: list[int]) -> bool:
        self.accepted += tokens
        return len(self.accepted) <= self.length

    def validate_tokens(self, tokens: list[int]) -> int:
        return min(len(tokens), self.length - len(self.accepted))

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def is_terminated(self) -> bool:
        return len(self.accepted) == self.length

    @property
    def error(self) -> str:
        return "too long" if len(self.accepted) > self.length else ""


def structured(request_id: str) -> tuple[Request, Future[Grammar]]:
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
    request = Request(request_id, [1, 2, 3], params, None, 0.0, max_model_len=4096)
    assert request.structured_output is not None and request.status == RequestStatus.WAITING_FOR_FSM
    future: Future[Grammar] = Future()
    request.structured_output.future = future
    return request, future


def free(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=8), None, 0.0, max_model_len=4096)


def test_a_request_waiting_for_its_grammar_is_passed_by_and_keeps_its_place() -> None:
    scheduler = make_scheduler()
    first, future = structured("structured")
    scheduler.add_request(first)
    scheduler.add_request(free("free"))
    assert [s.request_id for s in step(scheduler).scheduled] == ["free"]
    assert [r.request_id for r in scheduler.waiting] == ["structured"]
    grammar = CountingGrammar(3)
    future.set_result(grammar)
    assert [s.request_id for s in step(scheduler).scheduled] == ["free", "structured"]
    assert first.status == RequestStatus.RUNNING
    assert grammar.accepted == [7]  # the sampled token advanced the matcher


def test_a_complete_grammar_stops_the_request() -> None:
    scheduler = make_scheduler()
    request, future = structured("structured")
    future.set_result(CountingGrammar(2))
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert scheduler.update_from_output(first, fake_run(first))[0].finish_reason is None
    second = scheduler.schedule()
    (output,) = scheduler.update_from_output(second, fake_run(second))
    assert output.finish_reason == FinishReason.STOP and request.num_output_tokens == 2
    assert not scheduler.has_unfinished_requests()


def test_a_grammar_that_failed_to_compile_ends_only_its_request() -> None:
    scheduler = make_scheduler()
    request, future = structured("broken")
    scheduler.add_request(request)
    scheduler.add_request(free("free"))
    future.set_exception(ValueError("unclosed character class"))
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["free"]
    outputs = scheduler.update_from_output(out, fake_run(out))
    failed = next(o for o in outputs if o.request_id == "broken")
    assert failed.finish_reason == FinishReason.ERROR and failed.new_token_ids == []
    assert failed.error is not None and "unclosed character class" in failed.error
    assert list(scheduler.requests) == ["free"]


def test_a_rejected_token_ends_the_request_with_an_error() -> None:
    scheduler = make_scheduler()
    request, future = structured("structured")
    future.set_result(CountingGrammar(0))  # rejects any token
    scheduler.add_request(request)
    out = scheduler.schedule()
    (output,) = scheduler.update_from_output(out, fake_run(out))
    assert output.finish_reason == FinishReason.ERROR
    assert output.error is not None and "too long" in output.error
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.block_pool.num_blocks


def test_any_exception_of_the_compile_ends_only_its_request() -> None:
    """The first structured request also loads the tokenizer there: an OSError must not end the core."""
    scheduler = make_scheduler()
    request, future = structured("broken")
    scheduler.add_request(request)
    scheduler.add_request(free("free"))
    future.set_exception(OSError("tokenizer.json: no such file"))
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, fake_run(out))
    failed = next(o for o in outputs if o.request_id == "broken")
    assert failed.finish_reason == FinishReason.ERROR and "no such file" in (failed.error or "")
    assert list(scheduler.requests) == ["free"]
