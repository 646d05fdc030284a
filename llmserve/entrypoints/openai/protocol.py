"""Request bodies of the OpenAI API, as pydantic models.

Unknown fields are refused, as OpenAI does; so are non-finite numbers (`NaN`, `1e999`) and strings
that are not valid Unicode (a lone surrogate, `"\\ud800"`), which would fail only inside the engine.
OpenAI fields we do not implement are declared only to be told apart: each lists its harmless values
(those that change nothing, like `tools: []`), and any other value is refused with a 400 naming the
field, never silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from llmserve.engine.input_processor import PromptType, TokensPrompt
from llmserve.engine.input_processor import check_context_length as check_context_length
from llmserve.sampling_params import INT64_MAX, RequestOutputKind, SamplingParams, is_unicode
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


class SamplingRequest(OpenAIRequest):
    """The fields completions and chat completions share: the model, sampling and streaming, and
    vLLM's extensions to both."""

    harmless: ClassVar[dict[str, tuple[object, ...]]] = {
        "use_beam_search": (False,),
        "length_penalty": (1.0,),  # beam search's only
        # true (the default) decodes as vLLM's fast detokenizer does, as ours does
        "spaces_between_special_tokens": (True,),
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
            output_kind=output_kind,
        )


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


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None  # accepted; chat templates do not use it

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        for part in value if isinstance(value, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"only text content parts are supported, got type {kind!r}")
        return value

    def for_template(self) -> dict[str, object]:
        """The message as chat templates expect it: one string of content; `developer` is OpenAI's
        newer name for `system`."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    harmless: ClassVar[dict[str, tuple[object, ...]]] = {
        **SamplingRequest.harmless,
        "best_of": (None, 1),
        "tools": (None, []),
        "tool_choice": (None, "none", "auto"),  # "auto" with no tools chooses none
        "parallel_tool_calls": (None, True, False),
        "functions": (None, []),
        "function_call": (None, "none"),
        "response_format": (None, {"type": "text"}),
        "modalities": (None, ["text"]),
        "audio": _UNSET,
        "prediction": _UNSET,
        "reasoning_effort": _UNSET,
        "web_search_options": _UNSET,
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    store: bool | None = None  # nothing is stored either way
    metadata: dict[str, str] | None = None  # ignored, as it is when store is off
    service_tier: str | None = None  # one tier here
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
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
