"""`POST /v1/chat/completions`: the messages through the model's chat template, one engine request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from concurrent.futures import Executor
from contextlib import aclosing
from functools import partial
from typing import Any

from llmserve.engine.async_llm import AsyncLLM
from llmserve.entrypoints.openai.errors import OpenAIError, bad_request
from llmserve.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs
from llmserve.entrypoints.openai.protocol import ChatCompletionRequest, SamplingRequest, check_context_length
from llmserve.entrypoints.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChoiceLogprobs,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from llmserve.entrypoints.openai.serving_engine import OpenAIServing, PreparedPrompt
from llmserve.entrypoints.openai.serving_models import ServedModels
from llmserve.entrypoints.openai.streaming import DONE, error_event, event
from llmserve.entrypoints.openai.tool_parsers.tool_calls import (
    ToolCallStream,
    extract_tool_calls,
    make_tool_call_id,
)
from llmserve.entrypoints.openai.tool_use import ToolUse, tool_use
from llmserve.outputs import CompletionOutput
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams


class OpenAIServingChat(OpenAIServing):
    """`auto_tool_parser`: the `--tool-call-parser` when `--enable-auto-tool-choice` is on (see
    tool_use.py)."""

    def __init__(
        self,
        engine: AsyncLLM,
        models: ServedModels,
        stopping: asyncio.Event,
        executor: Executor | None = None,
        return_tokens_as_token_ids: bool = False,
        auto_tool_parser: str | None = None,
    ) -> None:
        super().__init__(engine, models, stopping, executor, return_tokens_as_token_ids)
        self.auto_tool_parser = auto_tool_parser

    def _start(
        self, request: ChatCompletionRequest
    ) -> tuple[str, str, SamplingParams, PreparedPrompt, ToolUse]:
        """Everything that can fail with a 400/404, done before the engine sees the request."""
        model = self.check_request(request)
        try:
            logprobs = request.engine_logprobs()
        except ValueError as e:
            raise bad_request(e, ChatCompletionRequest.model_fields) from e
        tools = tool_use(request, self.auto_tool_parser)
        params = self._constrained(self.sampling_params(request, request.max_new_tokens, logprobs), tools)
        prompt = self.render_chat(
            request.messages,
            request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.template_kwargs(),
            add_special_tokens=request.add_special_tokens,
            check_chars=params.truncate_prompt_tokens is None,
            tools=tools.tools,
        )
        request_id = self.response_id("chatcmpl", request)
        prepared = self.prepare(request_id, [prompt], params, request, "messages")[0]
        try:
            check_context_length(len(prepared.token_ids), params.max_tokens, self.engine.limits.max_model_len)
        except ValueError as e:
            given = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
            raise OpenAIError(str(e), param=given) from e
        return request_id, model, params, prepared, tools

    async def check_constraint(self, request: SamplingRequest) -> None:
        """Also the forced tool choices' schema (see `_constrained`)."""
        try:
            assert isinstance(request, ChatCompletionRequest)
            schema = tool_use(request, self.auto_tool_parser).schema
        except (OpenAIError, ValueError):
            return  # refused again, with its message, as the request is prepared
        if schema is None:
            await super().check_constraint(request)
        else:
            await self.check_structured_outputs_async(StructuredOutputsParams(json=schema), "tools")

    def _constrained(self, params: SamplingParams, tools: ToolUse) -> SamplingParams:
        """The forced tool choices' schema as the request's structured output."""
        if tools.schema is None:
            return params
        if params.structured_outputs is not None:
            raise OpenAIError(
                "tool_choice (required or a named function) constrains the output, as response_format and "
                "structured_outputs do: send only one.",
                param="tool_choice",
            )
        constraint = StructuredOutputsParams(json=tools.schema)
        self.check_structured_outputs(constraint, "tools")
        return params.clone(structured_outputs=constraint)

    async def create(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        # tokenizing (and the chat template) in the worker thread: a long prompt must not stall the loop
        request_id, model, params, prompt, tools = await self.run_blocking(partial(self._start, request))
        samples: list[CompletionOutput] = []
        prompt_lps = None
        async with aclosing(self.generate(request_id, [prompt], params)) as stream:
            async for _, output in stream:
                samples = output.outputs
                if output.prompt_logprobs is not None:
                    prompt_lps = prompt_logprobs(output.prompt_logprobs)
        echoed, as_ids = _echoed(request), self.token_ids_as_tokens(request)
        choices = [_choice(s, echoed, tools, self._logprobs(s, params, as_ids)) for s in samples]
        usage = UsageInfo.of(len(prompt.token_ids), sum(len(s.token_ids) for s in samples))
        return ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage, prompt_logprobs=prompt_lps
        )

    def create_stream(self, request: ChatCompletionRequest) -> AsyncGenerator[str, None]:
        """Validates now (errors are raised here, before the 200); the returned events do the rest."""
        request_id, model, params, prompt, tools = self._start(request)
        return self._events(request, request_id, model, params, prompt, tools)

    async def _events(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model: str,
        params: SamplingParams,
        prompt: PreparedPrompt,
        tools: ToolUse,
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
        calls: dict[int, ToolCallStream] = {}
        if tools.parser is not None:
            calls = {i: ToolCallStream(tools.parser(), tools.max_calls) for i in range(params.n)}
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
                        delta, finish = _delta(s, calls.get(s.index), tools.calls_finish)
                        logprobs = self._logprobs(s, params, as_ids)
                        if delta or finish or logprobs:
                            choices.append(
                                ChatChunkChoice(
                                    index=s.index, delta=delta, logprobs=logprobs, finish_reason=finish
                                )
                            )
                    if choices:
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


def _choice(
    sample: CompletionOutput, echoed: str, tools: ToolUse, logprobs: ChoiceLogprobs | None
) -> ChatChoice:
    """One finished sample; with a tool parser, its calls read out of the text."""
    content: str | None = echoed + sample.text
    calls: list[tuple[str, str]] = []
    if tools.parser is not None:
        text, calls = extract_tool_calls(tools.parser(), sample.text, tools.max_calls)
        content = echoed + text if text is not None else echoed or None
    tool_calls = [
        ToolCall(id=make_tool_call_id(), function=FunctionCall(name=n, arguments=a)) for n, a in calls
    ]
    return ChatChoice(
        index=sample.index,
        message=AssistantMessage(content=content, tool_calls=tool_calls or None),
        logprobs=logprobs,
        finish_reason=_finish(sample.finish_reason, bool(calls), tools.calls_finish),
    )


def _delta(
    sample: CompletionOutput, calls: ToolCallStream | None, calls_finish: str
) -> tuple[dict[str, Any], str | None]:
    """A streamed sample's delta and finish reason. The delta may be empty: a tool parser holds back
    text that may yet open a call."""
    finish = sample.finish_reason
    if calls is None:
        return ({"content": sample.text} if sample.text or not finish else {}), finish
    delta = calls.delta(sample.text, final=finish is not None)
    return delta, _finish(finish, calls.called, calls_finish)


def _finish(reason: str | None, called: bool, calls_finish: str) -> str | None:
    """`calls_finish` (see `ToolUse`) for an output that ended with calls; `length` stays (a call may
    be cut)."""
    return calls_finish if called and reason == "stop" else reason


def _echoed(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply starts with the last message when that is the replying role's
    (the assistant's), such as the text `continue_final_message` continues."""
    last = request.messages[-1]
    return str(last.for_template()["content"]) if request.echo and last.role == "assistant" else ""
