"""`POST /v1/completions`: one engine request per prompt; choice `prompt_index * n + sample_index`."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial

from llmserve.entrypoints.openai.errors import OpenAIError, bad_request
from llmserve.entrypoints.openai.logprobs import completion_logprobs, concat, echo_logprobs, prompt_logprobs
from llmserve.entrypoints.openai.protocol import CompletionRequest, check_context_length
from llmserve.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptLogprobs,
    UsageInfo,
)
from llmserve.entrypoints.openai.serving_engine import OpenAIServing, PreparedPrompt
from llmserve.entrypoints.openai.streaming import DONE, error_event, event
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams


@dataclass
class Echo:
    """The prompt as `echo` returns it before the generated text: its text and, when logprobs were
    asked, its tokens' logprobs, after which the generated tokens' text offsets continue."""

    text: str
    logprobs: CompletionLogprobs | None = None
    text_offset: int = 0


class OpenAIServingCompletion(OpenAIServing):
    def _start(self, request: CompletionRequest) -> tuple[str, str, SamplingParams, list[PreparedPrompt]]:
        """Everything that can fail with a 400/404, done before the engine sees the request."""
        model = self.check_request(request)
        # echo with logprobs returns the prompt's logprobs first: the engine computes them
        echoed = request.logprobs if request.echo else None
        params = self.sampling_params(request, request.max_tokens, request.logprobs, echoed)
        try:
            prompts = request.prompts()
        except ValueError as e:
            raise bad_request(e, CompletionRequest.model_fields) from e
        request_id = self.response_id("cmpl", request)
        prepared = self.prepare(request_id, prompts, params, request, "prompt")
        max_model_len = self.engine.limits.max_model_len
        for prompt in prepared:
            try:
                check_context_length(len(prompt.token_ids), params.max_tokens, max_model_len)
            except ValueError as e:
                raise OpenAIError(str(e), param="max_tokens") from e
        return request_id, model, params, prepared

    def _echo(self, request: CompletionRequest, prompt: PreparedPrompt, output: RequestOutput) -> Echo | None:
        """What echo returns for this prompt; `output` is the first (or only) one of its request."""
        if not request.echo:
            return None
        tokenizer = self.engine.tokenizer
        text = prompt.text if prompt.text is not None else str(tokenizer.decode(prompt.token_ids))
        if request.logprobs is None:
            return Echo(text)
        if output.prompt_logprobs is None:
            raise RuntimeError("the engine returned no prompt logprobs")
        first = str(tokenizer.decode(prompt.token_ids[:1]))
        logprobs, text_offset = echo_logprobs(
            prompt.token_ids,
            output.prompt_logprobs,
            request.logprobs,
            first,
            self.token_ids_as_tokens(request),
        )
        return Echo(text, logprobs, text_offset)

    async def create(self, request: CompletionRequest) -> CompletionResponse:
        # tokenizing in the worker thread: a long prompt must not stall the loop
        request_id, model, params, prompts = await self.run_blocking(partial(self._start, request))
        finals: dict[int, RequestOutput] = {}
        async with aclosing(self.generate(request_id, prompts, params)) as stream:
            async for i, output in stream:
                finals[i] = output
        choices: list[CompletionChoice] = []
        completion_tokens = 0
        as_ids = self.token_ids_as_tokens(request)
        for i, prompt in enumerate(prompts):
            echo = self._echo(request, prompt, finals[i])
            asked = request.prompt_logprobs is not None and finals[i].prompt_logprobs is not None
            prompt_lps = prompt_logprobs(finals[i].prompt_logprobs or []) if asked else None
            for sample in finals[i].outputs:
                completion_tokens += len(sample.token_ids)
                choice, _ = self._choice(
                    i * params.n + sample.index, sample, params, 0, as_ids, echo, prompt_lps
                )
                choices.append(choice)
        usage = UsageInfo.of(sum(len(p.token_ids) for p in prompts), completion_tokens)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    def create_stream(self, request: CompletionRequest) -> AsyncGenerator[str, None]:
        """Validates now (errors are raised here, before the 200); the returned events do the rest."""
        request_id, model, params, prompts = self._start(request)
        return self._events(request, request_id, model, params, prompts)

    async def _events(
        self,
        request: CompletionRequest,
        request_id: str,
        model: str,
        params: SamplingParams,
        prompts: list[PreparedPrompt],
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        unechoed = set(range(len(prompts) * params.n)) if request.echo else set()
        echoes: dict[int, Echo | None] = {}  # by prompt, from its request's first output
        text_offsets = [0] * (len(prompts) * params.n)
        prompt_tokens, completion_tokens = sum(len(p.token_ids) for p in prompts), 0
        as_ids = self.token_ids_as_tokens(request)
        try:
            async with aclosing(self.generate(request_id, prompts, params)) as stream:
                async for i, output in stream:
                    choices: list[CompletionChoice] = []
                    if i not in echoes:
                        echoes[i] = self._echo(request, prompts[i], output)
                    for sample in output.outputs:
                        index = i * params.n + sample.index
                        echo = echoes[i] if index in unechoed else None
                        unechoed.discard(index)
                        completion_tokens += len(sample.token_ids)
                        choice, text_offsets[index] = self._choice(
                            index, sample, params, text_offsets[index], as_ids, echo
                        )
                        choices.append(choice)
                    so_far = (
                        UsageInfo.of(prompt_tokens, completion_tokens) if request.continuous_usage else None
                    )
                    yield event(
                        CompletionResponse(
                            id=request_id, created=created, model=model, choices=choices, usage=so_far
                        )
                    )
            if request.include_usage:
                usage = UsageInfo.of(prompt_tokens, completion_tokens)
                yield event(
                    CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
                )
        except Exception as e:  # a closed or cancelled stream is no Exception: it just ends
            yield error_event(e)
        yield DONE

    @staticmethod
    def _choice(
        index: int,
        sample: CompletionOutput,
        params: SamplingParams,
        text_offset: int,
        as_ids: bool,
        echo: Echo | None = None,
        prompt_lps: PromptLogprobs | None = None,
    ) -> tuple[CompletionChoice, int]:
        """The choice for these tokens (after the echoed prompt, if any), and the text offset after
        them (for the next delta's logprobs); `as_ids`: tokens named by id."""
        prefix, logprobs = "", None
        if echo is not None:
            prefix, logprobs = echo.text, echo.logprobs
            text_offset = echo.text_offset if echo.logprobs is not None else text_offset
        if params.logprobs is not None and sample.logprobs is not None:
            generated, text_offset = completion_logprobs(
                sample.token_ids, sample.logprobs, params.logprobs, text_offset, as_ids
            )
            logprobs = generated if logprobs is None else concat(logprobs, generated)
        choice = CompletionChoice(
            index=index,
            text=prefix + sample.text,
            logprobs=logprobs,
            finish_reason=sample.finish_reason,
            prompt_logprobs=prompt_lps,
        )
        return choice, text_offset
