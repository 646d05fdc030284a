"""What every generating endpoint shares: validation that completes before anything reaches the
engine (so a bad prompt in a batch submits none), and the engine streams of one API request."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from jinja2 import TemplateError

from llmserve.config import ResolvedRunner
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.input_processor import PromptType, TokensPrompt, check_runner
from llmserve.engine.queue_limits import EngineOverloadedError
from llmserve.entrypoints.openai.data_parallel import RANK_HEADER
from llmserve.entrypoints.openai.errors import OpenAIError, bad_request, engine_dead
from llmserve.entrypoints.openai.protocol import ChatMessage, SamplingRequest
from llmserve.entrypoints.openai.serving_models import ServedModels
from llmserve.entrypoints.openai.streaming import merge_streams
from llmserve.outputs import RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from llmserve.structured_output import grammars
from llmserve.structured_output.grammars import StructuredOutputError

T = TypeVar("T")

# What a 503 for overload tells clients to wait before retrying: the queue drains at the engine's
# pace, which the front end does not predict; a second keeps retries from hammering a full server
# while letting them back in as soon as a slot frees.
RETRY_AFTER_SECONDS = 1


class ServerOverloaded(OpenAIError):
    """A 503 with `Retry-After`: the queue is full, or the request waited past max_queue_time."""

    def __init__(self, message: str) -> None:
        super().__init__(message, status=503, type="server_error", code="server_overloaded")

    def response(self) -> JSONResponse:
        response = super().response()
        response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response


@dataclass
class PreparedPrompt:
    """A validated prompt; `text` is None when it came as token ids."""

    token_ids: list[int]
    text: str | None
    priority: int = 0
    data_parallel_rank: int | None = None
    cache_salt: str | None = None

    def engine_prompt(self) -> TokensPrompt:
        """What the engine takes: the tokens, and the salt that keeps their KV blocks to its tenant."""
        prompt = TokensPrompt(prompt_token_ids=self.token_ids)
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        return prompt


class OpenAIServing:
    """`stopping` is set when the server shuts down: requests still running then end with a 503.
    `executor` (owned by the caller) runs `run_blocking` work: one worker keeps the tokenizer used by
    one thread at a time; None means asyncio's default executor. `return_tokens_as_token_ids` is the
    default of the request field of that name (vLLM's `--return-tokens-as-token-ids`)."""

    def __init__(
        self,
        engine: AsyncLLM,
        models: ServedModels,
        stopping: asyncio.Event,
        executor: Executor | None = None,
        return_tokens_as_token_ids: bool = False,
    ) -> None:
        self.engine = engine
        self.models = models
        self.stopping = stopping
        self.executor = executor
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.tokenizer = engine.tokenizer  # used by one thread at a time: the executor's

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """No text prompt longer than this fits max_model_len, so it is refused without tokenizing.
        A token covers at most as many characters as the vocabulary's longest entry (byte-level
        vocabularies spell each byte as one character, so a character of text is at least one there);
        doubled for normalizers that merge characters (NFKC)."""
        longest = max(map(len, self.tokenizer.get_vocab()))
        return 2 * longest * self.engine.limits.max_model_len

    def check_prompt_chars(self, chars: int, field: str) -> None:
        """Refuses, before tokenizing, a prompt of `chars` characters that cannot fit."""
        if chars > self.max_prompt_chars:
            max_len = self.engine.limits.max_model_len
            raise OpenAIError(
                f"The prompt is {chars} characters long, more than any {max_len} tokens "
                f"(max_model_len) can spell: shorten it.",
                param=field,
            )

    @staticmethod
    def response_id(prefix: str, request: SamplingRequest) -> str:
        """vLLM's: `{prefix}-{id}`, the id the client chose (X-Request-Id or `request_id`) or a new one."""
        return f"{prefix}-{request.request_id or uuid.uuid4().hex}"

    def token_ids_as_tokens(self, request: SamplingRequest) -> bool:
        """Whether logprobs name tokens "token_id:<id>": the request's choice, else the server's."""
        if request.return_tokens_as_token_ids is None:
            return self.return_tokens_as_token_ids
        return request.return_tokens_as_token_ids

    async def run_blocking(self, work: Callable[[], T]) -> T:
        """`work()` in the executor: tokenizing a megabyte prompt takes seconds, during which the event
        loop must keep answering /health and feeding the running streams."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, work)

    def resolve_model(self, name: str | None, runner: ResolvedRunner) -> str:
        """The model name to answer with, once the engine is alive (else a 503) and is of `runner` (else
        a 400 naming `model`)."""
        if self.engine.errored:
            raise engine_dead()
        model = self.models.resolve(name)
        try:
            check_runner(self.engine.limits, runner)
        except ValueError as e:
            raise OpenAIError(str(e), param="model") from e
        return model

    def check_request(self, request: SamplingRequest) -> str:
        """The model name to answer with, once the engine is alive and the streaming fields agree."""
        model = self.resolve_model(request.model, "generate")
        if request.stream_options is not None and not request.stream:
            raise OpenAIError(
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                param="stream_options",
            )
        return model

    def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Streams get deltas; the others only the finished output."""
        kind = RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY
        try:
            params = request.sampling_params(max_tokens, logprobs, kind, prompt_logprobs)
        except ValueError as e:
            raise bad_request(e, type(request).model_fields) from e
        if params.structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs, _constraint_field(request))
        return params

    def check_structured_outputs(self, params: StructuredOutputsParams, field: str | None = None) -> None:
        """A schema, regex or grammar past the limits or that cannot compile for this tokenizer is a 400
        here, naming the request's `field` (default: `structured_outputs.<kind>`) and the problem, before
        the engine sees it: there it would fail only once the request is running. Cheap once
        `check_structured_outputs_async` passed the same params."""
        limits = self.engine.config.structured_outputs_config
        for checked, named, given in _constraint_checks(params, field):
            try:
                grammars.check(checked, self.engine.tokenizer, limits)
            except ValueError as e:
                raise OpenAIError(str(e).replace(named, given, 1), param=given) from e

    async def check_structured_outputs_async(
        self, params: StructuredOutputsParams | None, field: str | None = None
    ) -> None:
        """`check_structured_outputs` on a grammar thread, under the grammar timeout: called before the
        request is prepared, so that one heavy grammar never holds the thread every request's
        preparation shares."""
        limits = self.engine.config.structured_outputs_config
        for checked, named, given in _constraint_checks(params, field) if params is not None else ():
            try:
                await grammars.check_async(checked, self.engine.tokenizer, limits)
            except ValueError as e:
                raise OpenAIError(str(e).replace(named, given, 1), param=given) from e

    async def check_constraint(self, request: SamplingRequest) -> None:
        """The request's constraint, checked (`check_structured_outputs_async`) before the request is
        prepared. Fields that conflict are left for the preparation to refuse."""
        try:
            params = request.structured_outputs_params()
        except ValueError:
            return
        await self.check_structured_outputs_async(params, _constraint_field(request))

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        check_chars: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> TokensPrompt:
        """The messages (and `tools`, for the template's tools section) through the chat template
        (vLLM's options), tokenized. With `check_chars`, a rendered prompt too long to fit is refused
        before tokenizing, as a text prompt is."""
        conversation: list[dict[str, object]] = [m.for_template() for m in messages]
        try:
            text = self.engine.input_processor.render_chat_text(
                conversation,
                None,
                add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
                tools=tools,
            )
        except TemplateError as e:
            raise OpenAIError(f"The chat template failed on these messages: {e}", param="messages") from e
        except ValueError as e:
            raise bad_request(e, ("continue_final_message", "chat_template_kwargs"), "messages") from e
        if check_chars:
            self.check_prompt_chars(len(text), "messages")
        return TokensPrompt(
            prompt_token_ids=self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        )

    def prepare(
        self,
        request_id: str,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        request: SamplingRequest,
        prompt_field: str,
    ) -> list[PreparedPrompt]:
        """Tokenize and validate every prompt (length, vocabulary, logprobs limit); a `ValueError`
        becomes a 400 naming the field, `prompt_field` when the prompt itself is at fault. A full
        queue is a 503 here, before the response starts (`generate` checks again, atomically)."""
        try:
            self.engine.config.scheduler_config.check_priority(request.priority)
        except ValueError as e:
            raise bad_request(e, type(request).model_fields) from e
        try:
            self.engine.engine_core.check_data_parallel_rank(request.data_parallel_rank)
        except ValueError as e:
            raise OpenAIError(str(e), param=RANK_HEADER) from e
        processor = self.engine.input_processor
        truncating = params.truncate_prompt_tokens is not None
        for prompt in prompts:
            text = prompt if isinstance(prompt, str) else prompt.get("prompt")
            if isinstance(text, str) and not truncating:
                self.check_prompt_chars(len(text), prompt_field)
        out: list[PreparedPrompt] = []
        for i, prompt in enumerate(prompts):
            try:
                core_request, text = processor.process_inputs(
                    f"{request_id}-{i}", prompt, params, add_special_tokens=request.add_special_tokens
                )
            except ValueError as e:
                raise bad_request(e, type(request).model_fields, prompt_field) from e
            # a truncated prompt's text is longer than its tokens': echo decodes the tokens instead
            kept = None if truncating else text
            out.append(
                PreparedPrompt(
                    core_request.prompt_token_ids,
                    kept,
                    request.priority,
                    request.data_parallel_rank,
                    request.cache_salt,
                )
            )
        try:
            self.engine.queue.check(len(out) * params.n, sum(len(p.token_ids) for p in out) * params.n)
        except EngineOverloadedError as e:
            raise ServerOverloaded(str(e)) from e
        return out

    def generate(
        self, request_id: str, prompts: list[PreparedPrompt], params: SamplingParams
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """One engine request per prompt, merged; items are (prompt index, output). A full queue or a
        queue timeout raises `ServerOverloaded`. The engine's ids get a fresh part, as vLLM's do: a
        client's `request_id` need not be unique."""
        engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        streams = [
            self.engine.generate(
                p.engine_prompt(),
                params,
                f"{engine_id}-{i}",
                priority=p.priority,
                data_parallel_rank=p.data_parallel_rank,
            )
            for i, p in enumerate(prompts)
        ]
        return _as_openai_errors(merge_streams(streams, self.stopping))


def _constraint_field(request: SamplingRequest) -> str | None:
    """The field that set the request's constraint when it is not `structured_outputs`."""
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    return "response_format.json_schema.schema" if fmt.type == "json_schema" else "response_format"


def _constraint_checks(
    params: StructuredOutputsParams, field: str | None
) -> list[tuple[StructuredOutputsParams, str, str]]:
    """(params to check, the field their errors name, the field the request used) for the constraint
    and its whitespace pattern, the pattern first so that its errors name it."""
    own = f"structured_outputs.{params.kind}"
    checks = [(params, own, field or own)]
    if params.whitespace_pattern:
        pattern = StructuredOutputsParams(regex=params.whitespace_pattern)
        checks.insert(0, (pattern, "structured_outputs.regex", "structured_outputs.whitespace_pattern"))
    return checks


async def _as_openai_errors(stream: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """A full queue or a queue timeout is a 503; a grammar that failed in the core (one that passed the
    front end's check, then rejected a token, as a regex whose lexer outgrows llguidance's limits) is
    the client's 400, with the first line of the core's message (the rest dumps the matcher)."""
    async with aclosing(stream):
        try:
            async for item in stream:
                yield item
        except EngineOverloadedError as e:
            raise ServerOverloaded(str(e)) from e
        except StructuredOutputError as e:
            reason = str(e).partition("\n")[0]
            message = f"The output's constraint failed during generation: {reason}"
            raise OpenAIError(message, param="structured_outputs") from e
