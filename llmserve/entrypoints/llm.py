"""`LLM`: the offline batch API, shaped like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import msgspec
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from llmserve.config import DEFAULT_MODEL, EngineArgs
from llmserve.engine.input_processor import ChatMessage, PromptType, check_context_length
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.parallel_sampling import fan_out
from llmserve.outputs import AnyRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """`LLM()` loads the default model; keyword arguments are `EngineArgs` fields."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model=model, **kwargs))
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs come back in the order of `prompts`. `priority` (one per prompt, lower first) needs
        `scheduling_policy="priority"`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompt_list = list(prompts)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(
                f"Got {len(priority)} priorities for {len(prompt_list)} prompts; they must match."
            )
        params = self._params_per_prompt(sampling_params, len(prompt_list))
        return self._run(prompt_list, params, use_tqdm, priority)

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of them, through the model's chat template;
        `continue_final_message`, `chat_template_kwargs` and `tools` (OpenAI's function tools, for the
        template's tools section) as in vLLM (see `InputProcessor.render_chat`)."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations: list[list[ChatMessage]] = [messages] if single else messages  # type: ignore[list-item,assignment]
        processor = self.llm_engine.input_processor
        prompts: list[PromptType] = [
            processor.render_chat(
                c,
                chat_template,
                add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
            for c in conversations
        ]
        return self._run(prompts, self._params_per_prompt(sampling_params, len(prompts)), use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's: each prompt's embedding, in the order of `prompts`, from an engine of the pooling
        runner (an encoder such as BertModel, or `runner="pooling"`)."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompt_list)
        else:
            params = list(pooling_params)
            if len(params) != len(prompt_list):
                raise ValueError(
                    f"Got {len(params)} pooling_params for {len(prompt_list)} prompts; they must match."
                )
        if truncate_prompt_tokens is not None:
            truncated = {"truncate_prompt_tokens": truncate_prompt_tokens}
            params = [msgspec.structs.replace(p, **truncated) for p in params]
        processor = self.llm_engine.input_processor
        ids = [str(next(self._request_counter)) for _ in prompt_list]
        # all validated before any is submitted
        requests = [processor.process_pooling_inputs(*item) for item in zip(ids, prompt_list, params)]
        for request in requests:
            self.llm_engine.submit(None, None, [request])
        outputs = self._collect(ids, use_tqdm)
        return [EmbeddingRequestOutput.from_base(o) for o in outputs if isinstance(o, PoolingRequestOutput)]

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"Got {len(params)} sampling_params for {n} prompts; they must match.")
        return params

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # Only finished outputs are returned: whatever the output kind, each holds the whole sample.
        params = [sp.clone(output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]
        ids = [str(next(self._request_counter)) for _ in prompts]
        # All validated before any is submitted, so one bad prompt leaves the engine untouched.
        priorities = priority or [0] * len(prompts)
        for p in priorities:
            engine.config.scheduler_config.check_priority(p)
        staged = [
            fan_out(engine.input_processor, i, p, sp, priority=rank)
            for i, p, sp, rank in zip(ids, prompts, params, priorities)
        ]
        # as the server's 400: max_tokens past the context would be cut short, at max_model_len
        max_model_len = engine.input_processor.limits.max_model_len
        for (_, _, requests), sp in zip(staged, params):
            check_context_length(len(requests[0].prompt_token_ids), sp.max_tokens, max_model_len)
        for item in staged:
            engine.submit(*item)
        return [o for o in self._collect(ids, use_tqdm) if isinstance(o, RequestOutput)]

    def _collect(self, ids: list[str], use_tqdm: bool) -> list[AnyRequestOutput]:
        """Step the engine until the requests `ids` finished; their outputs in that order."""
        engine = self.llm_engine
        order = {request_id: i for i, request_id in enumerate(ids)}
        results: list[AnyRequestOutput | None] = [None] * len(ids)
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            results[order[output.request_id]] = output
                            bar.update(1)
            except BaseException:
                engine.abort_request(list(order))
                raise
        return [r for r in results if r is not None]

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
