"""The synchronous engine: input processing → core client → output processing, one `step()` at a time."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from llmserve.config import EngineArgs, EngineConfig
from llmserve.engine.core_client import EngineCoreClient, InprocClient
from llmserve.engine.input_processor import InputProcessor, PromptType
from llmserve.engine.output_processor import OutputProcessor
from llmserve.model_executor.loader import load_tokenizer, resolve_model
from llmserve.model_executor.loader.tokenizer import eos_token_ids
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        source = resolve_model(config.model_config.model)
        self.tokenizer = load_tokenizer(source, config.model_config.chat_template)
        self.engine_core: EngineCoreClient = InprocClient(config)
        self.limits = self.engine_core.limits
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.limits,
            eos_token_ids(source, self.tokenizer),
            config.model_config.max_logprobs,
        )
        self.output_processor = OutputProcessor(self.tokenizer)

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
    ) -> None:
        """Validates before anything is registered, so a bad request leaves no trace."""
        request, prompt_text = self.input_processor.process_inputs(request_id, prompt, params, arrival_time)
        self.output_processor.add_request(request, prompt_text)
        self.engine_core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_outputs(outputs.outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def shutdown(self) -> None:
        self.engine_core.shutdown()
