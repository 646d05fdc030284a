"""`POST /v1/chat/completions`: the messages through the model's chat template, one engine request."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import partial

from llmserve.entrypoints.openai.errors import OpenAIError, bad_request
from llmserve.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs
from llmserve.entrypoints.openai.protocol import ChatCompletionRequest, check_context_length
from llmserve.entrypoints.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChoiceLogprobs,
    UsageInfo,
)
from llmserve.entrypoints.openai.serving_engine import OpenAIServing, PreparedPrompt
from llmserve.entrypoints.openai.streaming import DONE, error_event, event
from llmserve.outputs import CompletionOutput
from llmserve.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    def _start(self, request: ChatCompletionRequest) -> tuple[str, str, SamplingParams, PreparedPrompt]:
        """Everything that can fail with a 400/404, done before the engine sees the request."""
        model = self.check_request(request)
        try:
            logprobs = request.engine_logprobs()
        except ValueError as e:
            raise bad_request(e, ChatCompletionRequest.model_fields) from e
        params = self.sampling_params(request, request.max_new_tokens, logprobs)
        prompt = self.render_chat(
            request.messages,
            request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.template_kwargs(),
            add_special_tokens=request.add_special_tokens,
            check_chars=params.truncate_prompt_tokens is None,
        )
        request_id = self.response_id("chatcmpl", request)
        prepared = self.prepare(request_id, [prompt], params, request, "messages")[0]
        try:
            check_context_length(len(prepared.token_ids), params.max_tokens, self.engine.limits.max_model_len)
        except ValueError as e:
            given = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
            raise OpenAIError(str(e), param=given) from e
        return request_id, model, params, prepared

    async def create(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        # tokenizing (and the chat template) in the worker thread: a long prompt must not stall the loop
        request_id, model, params, prompt = await self.run_blocking(partial(self._start, request))
        samples: list[CompletionOutput] = []
        prompt_lps = None
        async with aclosing(self.generate(request_id, [prompt], params)) as stream:
            async for _, output in stream:
                samples = output.outputs
                if output.prompt_logprobs is not None:
                    prompt_lps = prompt_logprobs(output.prompt_logprobs)
        echoed, as_ids = _echoed(request), self.token_ids_as_tokens(request)
        choices = [
            ChatChoice(
                index=s.index,
                message=AssistantMessage(content=echoed + s.text),
                logprobs=self._logprobs(s, params, as_ids),
                finish_reason=s.finish_reason,
            )
            for s in samples
        ]
        usage = UsageInfo.of(len(prompt.token_ids), sum(len(s.token_ids) for s in samples))
        return ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage, prompt_logprobs=prompt_lps
        )

    def create_stream(self, request: ChatCompletionRequest) -> AsyncGenerator[str, None]:
        """Validates now (errors are raised here, before the 200); the returned events do the rest."""
        request_id, model, params, prompt = self._start(request)
        return self._events(request, request_id, model, params, prompt)

    async def _events(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model: str,
        params: SamplingParams,
        prompt: PreparedPrompt,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
            if usage is None and request.continuous_usage:
                usage = UsageInfo.of(len(prompt.token_ids), completion_tokens)
            return event(
                ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
            )

        completion_tokens = 0
        echoed, as_ids = _echoed(request), self.token_ids_as_tokens(request)
        try:
            for index in range(params.n):  # as OpenAI: the role first, with empty content
                yield chunk([ChatChunkChoice(index=index, delta={"role": "assistant", "content": ""})])
            for index in range(params.n if echoed else 0):
                yield chunk([ChatChunkChoice(index=index, delta={"content": echoed})])
            async with aclosing(self.generate(request_id, [prompt], params)) as stream:
                async for _, output in stream:
                    choices = []
                    for s in output.outputs:
                        completion_tokens += len(s.token_ids)
                        delta = {"content": s.text} if s.text or not s.finish_reason else {}
                        choices.append(
                            ChatChunkChoice(
                                index=s.index,
                                delta=delta,
                                logprobs=self._logprobs(s, params, as_ids),
                                finish_reason=s.finish_reason,
                            )
                        )
                    yield chunk(choices)
            if request.include_usage:
                yield chunk([], UsageInfo.of(len(prompt.token_ids), completion_tokens))
        except Exception as e:  # a closed or cancelled stream is no Exception: it just ends
            yield error_event(e)
        yield DONE

    @staticmethod
    def _logprobs(sample: CompletionOutput, params: SamplingParams, as_ids: bool) -> ChoiceLogprobs | None:
        if params.logprobs is None or sample.logprobs is None:
            return None
        return ChoiceLogprobs(
            content=chat_logprobs(sample.token_ids, sample.logprobs, params.logprobs, as_ids)
        )


def _echoed(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply starts with the last message when that is the replying role's
    (the assistant's), such as the text `continue_final_message` continues."""
    last = request.messages[-1]
    return str(last.for_template()["content"]) if request.echo and last.role == "assistant" else ""
