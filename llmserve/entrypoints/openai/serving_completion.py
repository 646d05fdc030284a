"""`POST /v1/completions`: one engine request per prompt; choice `prompt_index * n + sample_index`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing

from llmserve.entrypoints.openai.errors import OpenAIError, bad_request
from llmserve.entrypoints.openai.logprobs import completion_logprobs
from llmserve.entrypoints.openai.protocol import CompletionRequest
from llmserve.entrypoints.openai.responses import CompletionChoice, CompletionResponse, UsageInfo
from llmserve.entrypoints.openai.serving_engine import OpenAIServing, PreparedPrompt
from llmserve.entrypoints.openai.streaming import DONE, error_event, event
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    def _start(self, request: CompletionRequest) -> tuple[str, str, SamplingParams, list[PreparedPrompt]]:
        """Everything that can fail with a 400/404, done before the engine sees the request."""
        model = self.check_request(request)
        if request.echo and request.logprobs is not None:
            raise OpenAIError(
                "echo with logprobs is not supported: the engine returns no prompt logprobs.", param="echo"
            )
        params = self.sampling_params(request, request.max_tokens, request.logprobs)
        try:
            prompts = request.prompts()
        except ValueError as e:
            raise bad_request(e, CompletionRequest.model_fields) from e
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return request_id, model, params, self.prepare(request_id, prompts, params, request, "prompt")

    def _echo(self, prompt: PreparedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return str(self.engine.tokenizer.decode(prompt.token_ids))

    async def create(self, request: CompletionRequest) -> CompletionResponse:
        request_id, model, params, prompts = self._start(request)
        finals: dict[int, RequestOutput] = {}
        async with aclosing(self.generate(request_id, prompts, params)) as stream:
            async for i, output in stream:
                finals[i] = output
        choices: list[CompletionChoice] = []
        completion_tokens = 0
        for i, prompt in enumerate(prompts):
            prefix = self._echo(prompt) if request.echo else ""
            for sample in finals[i].outputs:
                completion_tokens += len(sample.token_ids)
                choice, _ = self._choice(i * params.n + sample.index, sample, prefix, params, 0)
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
        text_offsets = [0] * (len(prompts) * params.n)
        completion_tokens = 0
        try:
            async with aclosing(self.generate(request_id, prompts, params)) as stream:
                async for i, output in stream:
                    choices: list[CompletionChoice] = []
                    for sample in output.outputs:
                        index = i * params.n + sample.index
                        prefix = self._echo(prompts[i]) if index in unechoed else ""
                        unechoed.discard(index)
                        completion_tokens += len(sample.token_ids)
                        choice, text_offsets[index] = self._choice(
                            index, sample, prefix, params, text_offsets[index]
                        )
                        choices.append(choice)
                    yield event(
                        CompletionResponse(id=request_id, created=created, model=model, choices=choices)
                    )
            if request.include_usage:
                usage = UsageInfo.of(sum(len(p.token_ids) for p in prompts), completion_tokens)
                yield event(
                    CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
                )
        except Exception as e:  # a closed or cancelled stream is no Exception: it just ends
            yield error_event(e)
        yield DONE

    @staticmethod
    def _choice(
        index: int, sample: CompletionOutput, prefix: str, params: SamplingParams, text_offset: int
    ) -> tuple[CompletionChoice, int]:
        """The choice for these tokens, and the text offset after them (for the next delta's logprobs)."""
        logprobs = None
        if params.logprobs is not None and sample.logprobs is not None:
            logprobs, text_offset = completion_logprobs(
                sample.token_ids, sample.logprobs, params.logprobs, text_offset
            )
        choice = CompletionChoice(
            index=index, text=prefix + sample.text, logprobs=logprobs, finish_reason=sample.finish_reason
        )
        return choice, text_offset
