"""What every generating endpoint shares: validation that completes before anything reaches the
engine (so a bad prompt in a batch submits none), and the engine streams of one API request."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

from jinja2 import TemplateError

from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.input_processor import PromptType, TokensPrompt
from llmserve.entrypoints.openai.errors import OpenAIError, bad_request, engine_dead
from llmserve.entrypoints.openai.protocol import ChatMessage, SamplingRequest
from llmserve.entrypoints.openai.serving_models import ServedModels
from llmserve.entrypoints.openai.streaming import merge_streams
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")


@dataclass
class PreparedPrompt:
    """A validated prompt; `text` is None when it came as token ids."""

    token_ids: list[int]
    text: str | None


class OpenAIServing:
    """`stopping` is set when the server shuts down: requests still running then end with a 503.
    `executor` (owned by the caller) runs `run_blocking` work: one worker keeps the tokenizer used by
    one thread at a time; None means asyncio's default executor."""

    def __init__(
        self,
        engine: AsyncLLM,
        models: ServedModels,
        stopping: asyncio.Event,
        executor: Executor | None = None,
    ) -> None:
        self.engine = engine
        self.models = models
        self.stopping = stopping
        self.executor = executor

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """No text prompt longer than this fits max_model_len, so it is refused without tokenizing.
        A token covers at most as many characters as the vocabulary's longest entry (byte-level
        vocabularies spell each byte as one character, so a character of text is at least one there);
        doubled for normalizers that merge characters (NFKC)."""
        longest = max(map(len, self.engine.tokenizer.get_vocab()))
        return 2 * longest * self.engine.limits.max_model_len

    async def run_blocking(self, work: Callable[[], T]) -> T:
        """`work()` in the executor: tokenizing a megabyte prompt takes seconds, during which the event
        loop must keep answering /health and feeding the running streams."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, work)

    def check_request(self, request: SamplingRequest) -> str:
        """The model name to answer with, once the engine is alive and the streaming fields agree."""
        if self.engine.errored:
            raise engine_dead()
        model = self.models.resolve(request.model)
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options",
            )
        return model

    @staticmethod
    def sampling_params(
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Streams get deltas; the others only the finished output."""
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        try:
            return request.sampling_params(max_tokens, logprobs, kind, prompt_logprobs)
        except ValueError as e:
            raise bad_request(e, type(request).model_fields) from e

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> TokensPrompt:
        conversation: list[dict[str, object]] = [m.for_template() for m in messages]
        try:
            return self.engine.input_processor.render_chat(conversation, None, add_generation_prompt)
        except (ValueError, TemplateError) as e:
            raise OpenAIError(f"The chat template failed on these messages: {e}", param="messages") from e

    def prepare(
        self,
        request_id: str,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        request: SamplingRequest,
        prompt_field: str,
    ) -> list[PreparedPrompt]:
        """Tokenize and validate every prompt (length, vocabulary, logprobs limit); a `ValueError`
        becomes a 400 naming the field, `prompt_field` when the prompt itself is at fault."""
        processor = self.engine.input_processor
        for prompt in prompts:
            text = prompt if isinstance(prompt, str) else prompt.get("prompt")
            if isinstance(text, str) and len(text) > self.max_prompt_chars:
                max_len = self.engine.limits.max_model_len
                raise OpenAIError(
                    f"The prompt is {len(text)} characters long, more than any {max_len} tokens "
                    f"(max_model_len) can spell: shorten it.",
                    param=prompt_field,
                )
        out: list[PreparedPrompt] = []
        for i, prompt in enumerate(prompts):
            try:
                core_request, text = processor.process_inputs(f"{request_id}-{i}", prompt, params)
            except ValueError as e:
                raise bad_request(e, type(request).model_fields, prompt_field) from e
            out.append(PreparedPrompt(core_request.prompt_token_ids, text))
        return out

    def generate(
        self, request_id: str, prompts: list[PreparedPrompt], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """One engine request per prompt, merged; items are (prompt index, output)."""
        return merge_streams(
            [
                self.engine.generate(TokensPrompt(prompt_token_ids=p.token_ids), params, f"{request_id}-{i}")
                for i, p in enumerate(prompts)
            ],
            self.stopping,
        )
