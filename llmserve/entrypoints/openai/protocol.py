"""Request bodies of the OpenAI API, as pydantic models.

Unknown fields are refused, as OpenAI does; so are non-finite numbers (`NaN`, `1e999`) and strings
that are not valid Unicode (a lone surrogate, `"\\ud800"`), which would fail only inside the engine.
OpenAI fields we do not implement are declared only to be told apart: each lists its harmless values
(those that change nothing, like `functions: []`), and any other value is refused with a 400 naming the
field, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from llmserve.engine.input_processor import PromptType, TokensPrompt
from llmserve.engine.input_processor import check_context_length as check_context_length
from llmserve.sampling_params import (
    INT64_MAX,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    is_unicode,
)
from llmserve.sampling_params import MAX_N as MAX_N

_UNSET: tuple[object, ...] = (None,)
# Sequences (prompts × n) one HTTP request may queue: a generous batch for offline-style clients,
# yet a bound on the work and per-sequence state a single request can pin in the server.
MAX_SEQUENCES_PER_REQUEST = 1024

# Token ids as JSON integers only: `true` is not token 1.
TokenIds = list[StrictInt]
# vLLM's `request_id` (or the X-Request-Id header) names the response; bounded, as every output
# message of the request carries it.
MAX_REQUEST_ID_CHARS = 1024
# vLLM's guided decoding fields, which vLLM replaced by `structured_outputs` and now ignores silently (its
# users' most frequent complaint): here each is refused, naming its replacement.
REPLACED_FIELDS = {
    "guided_json": "structured_outputs.json, or response_format {type: json_schema}",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": "nothing: the server picks the backend (llguidance)",
}


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # field name → the values accepted although the feature is not implemented
    harmless: ClassVar[dict[str, tuple[object, ...]]] = {}

    @field_validator("*", mode="after")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = cls.harmless.get(info.field_name or "")
        if allowed is not None and value not in allowed:
            raise ValueError(f"{info.field_name} is not supported by this server")
        replacement = REPLACED_FIELDS.get(info.field_name or "")
        if replacement is not None and value is not None:
            raise ValueError(f"{info.field_name} was removed (as in vLLM): use {replacement}")
        if not _all_unicode(value):
            raise ValueError(f"{info.field_name} is not valid Unicode: it holds a lone surrogate")
        return value


def _all_unicode(value: object) -> bool:
    """No string in `value` (through lists and dicts, keys too) holds a lone surrogate."""
    if isinstance(value, str):
        return is_unicode(value)
    if isinstance(value, list):
        return all(_all_unicode(v) for v in value)
    if isinstance(value, dict):
        return all(_all_unicode(k) and _all_unicode(v) for k, v in value.items())
    return True


class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class JsonSchemaFormat(OpenAIRequest):
    """OpenAI's `response_format.json_schema`. The output always follows `schema`, whatever `strict` says
    (as in vLLM); `name` and `description` change nothing."""

    name: str
    description: str | None = None
    # OpenAI's `schema`, renamed here because pydantic's BaseModel has a `schema` method
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (any JSON object) or
    `json_schema` (its `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("type json_schema needs json_schema.schema, the JSON schema to follow")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is only read with type json_schema, not {self.type}")
        return self


# The fields of `StructuredOutputsParams` that choose the constraint; exactly one is set.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsRequest(OpenAIRequest):
    """vLLM's `structured_outputs` request field: `StructuredOutputsParams` as JSON."""

    # `json` is renamed here because pydantic's BaseModel has a `json` method
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_additional_properties: bool = True  # see StructuredOutputsParams
    whitespace_pattern: str | None = None


class SamplingRequest(OpenAIRequest):
    """The fields completions and chat completions share: the model, sampling and streaming, and
    vLLM's extensions to both."""

    harmless: ClassVar[dict[str, tuple[object, ...]]] = {
        "use_beam_search": (False,),
        "length_penalty": (1.0,),  # beam search's only
        # true (the default) decodes as vLLM's fast detokenizer does, as ours does
        "spaces_between_special_tokens": (True,),
        # vllm-router (an SGLang router) adds SGLang's fields to every body it forwards, at their
        # defaults: stop strings trimmed, no hidden states
        "no_stop_trim": (False,),
        "return_hidden_states": (False,),
    }

    model: str | None = None  # None: the first served model name
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # ignored, as OpenAI allows
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI sends token ids as strings
    bad_words: list[str] | None = None
    allowed_token_ids: TokenIds | None = None
    prompt_logprobs: int | None = None  # vLLM's extra; returned as `prompt_logprobs`, not streamed
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: max_model_len)
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:<id>"
    request_id: str | None = Field(None, max_length=MAX_REQUEST_ID_CHARS)  # vLLM's: the response id's
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own special tokens (a BOS) on the prompt
    use_beam_search: bool = False
    length_penalty: float = 1.0
    spaces_between_special_tokens: bool = True
    priority: StrictInt = 0  # vLLM's extra: lower is scheduled first (--scheduling-policy priority only)
    response_format: ResponseFormat | None = None  # vLLM reads it on completions too
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's
    cache_salt: str | None = None  # vLLM's: only requests of the same salt share prefix-cached KV blocks
    # the rank that must serve the request, from vLLM's X-data-parallel-rank header (data_parallel.py)
    data_parallel_rank: SkipJsonSchema[int | None] = None
    guided_json: SkipJsonSchema[Any] = None  # each guided_* field is refused (see REPLACED_FIELDS)
    guided_regex: SkipJsonSchema[Any] = None
    guided_choice: SkipJsonSchema[Any] = None
    guided_grammar: SkipJsonSchema[Any] = None
    guided_whitespace_pattern: SkipJsonSchema[Any] = None
    guided_decoding_backend: SkipJsonSchema[Any] = None
    no_stop_trim: SkipJsonSchema[bool] = False  # see `harmless`
    return_hidden_states: SkipJsonSchema[bool] = False

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, value: str | None) -> str | None:
        """vLLM's rule: an empty salt would read as no salt, sharing the cache it was sent to avoid."""
        if value is not None and not value:
            raise ValueError("must be a non-empty string if provided")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk, as vLLM sends it (guidellm asks for it to count tokens as they come)."""
        return (
            self.include_usage
            and self.stream_options is not None
            and self.stream_options.continuous_usage_stats
        )

    def engine_logit_bias(self) -> dict[int, float] | None:
        """`logit_bias` with integer token ids; raises `ValueError` when a key is not one."""
        if self.logit_bias is None:
            return None
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}.") from None
        return out

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        output_kind: RequestOutputKind,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Raises `ValueError` naming the field when a value is out of range. `prompt_logprobs`
        (completions' echo) is asked for in addition to the request's own."""
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not available when streaming.")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.engine_logit_bias(),
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            logprobs=logprobs,
            prompt_logprobs=_wider(self.prompt_logprobs, prompt_logprobs),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.structured_outputs_params(),
            output_kind=output_kind,
        )

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """`structured_outputs`, with `response_format`'s constraint when that is JSON (then only the
        options, `whitespace_pattern` and `disable_additional_properties`, may come from
        `structured_outputs`). Raises `ValueError` naming the field when the two conflict."""
        given = self.structured_outputs
        fields = {} if given is None else given.model_dump(by_alias=True, exclude_none=True)
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if any(kind in fields for kind in CONSTRAINTS):
                raise ValueError(
                    "response_format and structured_outputs both constrain the output: send only one."
                )
            if fmt.json_schema is not None:
                fields["json"] = fmt.json_schema.json_schema
            else:
                fields["json_object"] = True
        return StructuredOutputsParams(**fields) if fields else None


def _wider(a: int | None, b: int | None) -> int | None:
    """The larger of two top-k requests, where None asks for nothing and -1 for everything."""
    if a is None or b is None:
        return b if a is None else a
    return -1 if -1 in (a, b) else max(a, b)


Prompt = Annotated[
    str | list[str] | TokenIds | list[TokenIds],
    Field(description="text, texts, token ids or lists of token ids; one engine request per prompt"),
]


class CompletionRequest(SamplingRequest):
    harmless: ClassVar[dict[str, tuple[object, ...]]] = {
        **SamplingRequest.harmless,
        "suffix": _UNSET,
        "best_of": (None, 1),
    }

    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[PromptType]:
        """Each prompt on its own, texts as they are and token ids as `TokensPrompt`s."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if len(prompt) * self.n > MAX_SEQUENCES_PER_REQUEST and not isinstance(prompt[0], int):
            raise ValueError(
                f"n ({self.n}) times the number of prompts ({len(prompt)}) must be at most "
                f"{MAX_SEQUENCES_PER_REQUEST} sequences per request; split the batch."
            )
        out: list[PromptType] = []
        for item in prompt:
            if isinstance(item, int):  # one prompt of token ids
                return [TokensPrompt(prompt_token_ids=cast(list[int], prompt))]
            out.append(item if isinstance(item, str) else TokensPrompt(prompt_token_ids=item))
        return out


class TextPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class FunctionCallParam(OpenAIRequest):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(OpenAIRequest):
    """A call in an earlier assistant message, sent back with the conversation."""

    id: str
    type: Literal["function"]
    function: FunctionCallParam

    def for_template(self) -> dict[str, object]:
        """As vLLM gives it to chat templates: the arguments parsed (templates write them with
        `tojson`), or left as text when they are not JSON."""
        try:
            arguments: object = json.loads(self.function.arguments)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(OpenAIRequest):
    """A message of the conversation; the fields are validated in this order, so each validator sees
    the ones above it."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCallParam] | None = None  # the assistant's calls
    tool_call_id: str | None = Field(None, validate_default=True)  # the call a `tool` message answers
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None  # accepted; chat templates do not use it
    refusal: str | None = None  # an earlier answer's, sent back by clients; templates do not use it

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, value: list[ToolCallParam] | None, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if (value is None) == (info.data.get("role") == "tool"):
            if value is None:  # OpenAI's "Missing required parameter"
                raise PydanticCustomError("missing", "Field required")
            raise ValueError("only messages of role tool answer a tool call")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"only text content parts are supported, got type {kind!r}")
        return value

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, value: str | list[TextPart] | None, info: ValidationInfo) -> Any:
        """Content may be null only in an assistant message that calls tools (OpenAI's rule)."""
        if value is None and not info.data.get("tool_calls"):
            raise PydanticCustomError("missing", "Field required")
        return value

    def for_template(self) -> dict[str, object]:
        """The message as chat templates expect it: one string of content ("" for an assistant's
        calls alone); `developer` is OpenAI's newer name for `system`; calls and the id they answer
        as vLLM passes them."""
        if self.content is None or isinstance(self.content, str):
            content = self.content or ""
        else:
            content = "\n".join(p.text for p in self.content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, object] = {"role": role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(OpenAIRequest):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: no arguments
    strict: bool | None = None  # forced calls follow `parameters` always; `auto` ones never are


class ChatTool(OpenAIRequest):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(OpenAIRequest):
    name: str


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    harmless: ClassVar[dict[str, tuple[object, ...]]] = {
        **SamplingRequest.harmless,
        "best_of": (None, 1),
        "functions": (None, []),
        "function_call": (None, "none"),
        "modalities": (None, ["text"]),
        "audio": _UNSET,
        "prediction": _UNSET,
        "reasoning_effort": _UNSET,
        "web_search_options": _UNSET,
        # vllm-router's, at their defaults (see SamplingRequest): a model without a reasoning parser
        # has no reasoning to include, separate or stream
        "include_reasoning": (True,),
        "separate_reasoning": (True,),
        "stream_reasoning": (True,),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    store: bool | None = None  # nothing is stored either way
    metadata: dict[str, str] | None = None  # ignored, as it is when store is off
    service_tier: str | None = None  # one tier here
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # see tool_use.py
    parallel_tool_calls: bool | None = None  # false: at most one call
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    best_of: int | None = None
    # vLLM's chat extensions
    add_special_tokens: bool = False  # the chat template writes the special tokens
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, left open
    chat_template_kwargs: dict[str, Any] | None = None  # template variables
    documents: list[dict[str, str]] | None = None  # the template's `documents` (RAG)
    echo: bool = False  # the reply starts with the last message, when that is the assistant's
    include_reasoning: SkipJsonSchema[bool] = True  # see `harmless`
    separate_reasoning: SkipJsonSchema[bool] = True
    stream_reasoning: SkipJsonSchema[bool] = True

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _named_tool(cls, value: Any) -> Any:
        """A named choice's errors name the field inside it, with the correct usage (as vLLM's do)."""
        if not isinstance(value, dict):
            return value
        try:
            return NamedToolChoice.model_validate(value)
        except ValidationError as e:
            error = e.errors()[0]
            where = ".".join(map(str, error["loc"]))
            raise ValueError(
                f"{where}: {error['msg']}. Correct usage: "
                '{"type": "function", "function": {"name": "my_function"}}'
            ) from None

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _token_count(cls, value: int | None) -> int | None:
        """Checked here rather than by SamplingParams, so that the error names the field sent."""
        if value is not None and not 1 <= value <= INT64_MAX:
            raise ValueError(f"must be an integer from 1 to 2**63 - 1, got {value}")
        return value

    def template_kwargs(self) -> dict[str, Any]:
        """`chat_template_kwargs` with `documents`, as vLLM passes them to the template."""
        documents = {} if self.documents is None else {"documents": self.documents}
        return {**documents, **(self.chat_template_kwargs or {})}

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def engine_logprobs(self) -> int | None:
        """Chat's `logprobs: true` + `top_logprobs: k` is the engine's `logprobs=k`."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise ValueError("top_logprobs requires logprobs to be true")
            return None
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= INT64_MAX:
            raise ValueError(f"top_logprobs must be a non-negative integer, got {self.top_logprobs}.")
        return self.top_logprobs or 0


class TokenizeRequest(OpenAIRequest):
    """Either a `prompt` (as completions tokenize it) or `messages` (through the chat template, as chat
    completions do). `add_special_tokens` defaults as there: true for a prompt, false for messages."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: TokenIds
