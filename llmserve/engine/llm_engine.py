"""The synchronous engine: input processing → core client → output processing, one `step()` at a time."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from llmserve.config import EngineArgs, EngineConfig
from llmserve.contracts import EngineCoreRequest, FinishReason
from llmserve.engine.front_end import FrontEnd
from llmserve.engine.input_processor import PromptType
from llmserve.engine.parallel_sampling import ParentRequest, fan_out
from llmserve.outputs import AnyRequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.structured_output.grammars import StructuredOutputError


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        front = FrontEnd.start(config, asyncio_mode=False)
        self.tokenizer = front.tokenizer
        self.engine_core = front.engine_core
        self.limits = front.limits
        self.input_processor = front.input_processor
        self.output_processor = front.output_processor
        # the other requests' outputs of a step that raised, returned by the next step
        self._undelivered: list[AnyRequestOutput] = []

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validates before anything is registered, so a bad request leaves no trace."""
        self.config.scheduler_config.check_priority(priority)
        self.submit(*fan_out(self.input_processor, request_id, prompt, params, arrival_time, priority))

    def submit(
        self, prompt_text: str | None, parent: ParentRequest | None, requests: list[EngineCoreRequest]
    ) -> None:
        """Register already validated core requests (from `fan_out`) and send them to the core."""
        for index, request in enumerate(requests):
            self.output_processor.add_request(request, prompt_text, parent, index)
            self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self._undelivered) or self.output_processor.has_unfinished_requests()

    def step(self) -> list[AnyRequestOutput]:
        """Raises `StructuredOutputError` when requests' grammars failed: those requests are aborted
        (every sample of each), and the step's outputs of the others come with the next `step()`."""
        if self._undelivered:
            delivered, self._undelivered = self._undelivered, []
            return delivered
        if not self.output_processor.has_unfinished_requests():
            return []  # a core in another process would have no outputs to send: do not wait for one
        outputs = self.engine_core.get_output()
        states = self.output_processor.request_states
        failed = [
            o for o in outputs.outputs if o.finish_reason == FinishReason.ERROR and o.request_id in states
        ]
        if failed:
            self.abort_request(list(dict.fromkeys(states[o.request_id].external_id for o in failed)))
        processed = self.output_processor.process_outputs(outputs.outputs)  # skips the aborted ones
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        if failed:
            self._undelivered = processed.request_outputs
            raise StructuredOutputError(failed[0].error or "The request failed in the engine core.")
        return processed.request_outputs

    def shutdown(self) -> None:
        self.engine_core.shutdown()
