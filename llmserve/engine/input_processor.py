"""Prompt + sampling params → a validated, tokenized `EngineCoreRequest`, before anything reaches the core."""

from __future__ import annotations

import inspect
import time
from typing import Any, NotRequired, TypedDict, Union

from transformers import PreTrainedTokenizerBase

from llmserve.config import ResolvedLimits, ResolvedRunner, StructuredOutputsConfig
from llmserve.contracts import EngineCoreRequest
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import SamplingParams, is_unicode
from llmserve.structured_output import grammars


class TextPrompt(TypedDict):
    """`cache_salt` (vLLM's): only prompts of the same salt share prefix-cached KV blocks."""

    prompt: str
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    cache_salt: NotRequired[str]


PromptType = Union[str, TextPrompt, TokensPrompt]
ChatMessage = dict[str, object]

# Names `apply_chat_template` takes as its own arguments (and passes on as `conversations`): keys of
# `chat_template_kwargs` that would collide with them or change what it returns, instead of reaching
# the template. `documents` (vLLM's RAG field) is one too, but it reaches the template as it is.
_TEMPLATE_ARGUMENTS = {
    name
    for name, p in inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.items()
    if p.kind is not inspect.Parameter.VAR_KEYWORD and name not in ("self", "documents")
} | {"conversations"}


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's 400 (and its message) for a prompt plus `max_tokens` beyond the context: the engine would
    otherwise stop the request short, at max_model_len, with `finish_reason: "length"`."""
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion."
        )


def check_runner(limits: ResolvedLimits, runner: ResolvedRunner) -> None:
    """A request for the other runner than the engine's is refused (the message names `model`)."""
    if limits.runner == runner:
        return
    if runner == "generate":
        raise ValueError(
            "model serves embeddings here (runner pooling): it generates no text. Use /v1/embeddings "
            "(LLM.embed), or start the engine with runner generate."
        )
    raise ValueError(
        "model serves generation here (runner generate): it embeds nothing. Start the engine with runner "
        "pooling (an encoder such as BertModel takes it by itself)."
    )


def _cache_salt(prompt: PromptType) -> str | None:
    """The prompt dict's `cache_salt`: a non-empty string when given, as vLLM requires."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}.")
    if salt is not None and not is_unicode(salt):
        raise ValueError("cache_salt is not valid Unicode: it holds a lone surrogate.")
    return salt


def _check_continuable(conversation: list[ChatMessage], add_generation_prompt: bool) -> None:
    """`continue_final_message` continues an assistant message, and opens no new one (vLLM's rule)."""
    if add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true: "
            "set add_generation_prompt to false (its default is true)."
        )
    role = conversation[-1].get("role")
    if role != "assistant":
        raise ValueError(
            f"continue_final_message continues the last message, which must be the assistant's; got {role!r}."
        )


DEFAULT_GRAMMAR_LIMITS = StructuredOutputsConfig()


class InputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        limits: ResolvedLimits,
        eos_token_ids: list[int],
        max_logprobs: int = 20,
        grammar_limits: StructuredOutputsConfig = DEFAULT_GRAMMAR_LIMITS,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_logprobs = max_logprobs
        self.grammar_limits = grammar_limits
        # The first EOS id is the request's EOS; any others (e.g. Llama 3's) act as stop tokens.
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.extra_eos_ids = eos_token_ids[1:]

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        *,
        add_special_tokens: bool = True,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Returns the core request and the prompt text (None for a token-id prompt).
        `add_special_tokens` is the tokenizer's (a BOS, for models that have one) for text prompts."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        check_runner(self.limits, "generate")
        self._validate_params(params)
        cache_salt = _cache_salt(prompt)
        text, token_ids = self._tokenize(prompt, add_special_tokens)
        token_ids = self._truncate(token_ids, params.truncate_prompt_tokens)
        self._validate_tokens(token_ids)
        bad_words_token_ids = self._bad_words_token_ids(params.bad_words) if params.bad_words else None
        if self.extra_eos_ids and not params.ignore_eos:
            params = params.clone(stop_token_ids=[*(params.stop_token_ids or []), *self.extra_eos_ids])
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            bad_words_token_ids=bad_words_token_ids,
            priority=priority,
            cache_salt=cache_salt,
        )
        return request, text

    def process_pooling_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        *,
        add_special_tokens: bool = True,
    ) -> EngineCoreRequest:
        """The core request of a pooling (embedding) request. Its prompt may take all of max_model_len:
        nothing is generated after it. `truncate_prompt_tokens` keeps the last tokens, as vLLM's
        left truncation does; a text prompt keeps its special tokens around them."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}.")
        check_runner(self.limits, "pooling")
        if params.dimensions is not None:
            raise ValueError(
                "dimensions: this model does not support matryoshka representation, so its embeddings "
                "cannot be shortened."
            )
        keep = self._kept_tokens(params.truncate_prompt_tokens)
        text, token_ids = self._tokenize(prompt, add_special_tokens)
        if keep is not None and len(token_ids) > keep:
            token_ids = (
                token_ids[-keep:]
                if text is None
                else self.tokenizer.encode(
                    text, add_special_tokens=add_special_tokens, truncation=True, max_length=keep
                )
            )
        self._validate_tokens(token_ids, room_to_generate=False)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=SamplingParams(max_tokens=1),
            eos_token_id=None,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            pooling_params=params,
        )

    def render_chat(
        self,
        conversation: list[ChatMessage],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> TokensPrompt:
        """The conversation through the chat template, tokenized. The template writes the special
        tokens it wants; `add_special_tokens` adds the tokenizer's own (a BOS) on top, as vLLM's does."""
        text = self.render_chat_text(
            conversation,
            chat_template,
            add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        return TokensPrompt(
            prompt_token_ids=self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        )

    def render_chat_text(
        self,
        conversation: list[ChatMessage],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template's text, as vLLM renders it: `continue_final_message` leaves the last
        (assistant) message open, for the model to continue; `chat_template_kwargs` become template
        variables (e.g. Qwen3's `enable_thinking`); `tools` (OpenAI's function tools) go to the
        template's tools section, for models whose template has one."""
        if not isinstance(conversation, list) or not conversation:
            raise ValueError("A conversation must be a non-empty list of messages.")
        for message in conversation:
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"Each chat message needs a 'role', got {message!r}.")
        if continue_final_message:
            _check_continuable(conversation, add_generation_prompt)
        kwargs = dict(chat_template_kwargs or {})
        taken = sorted(set(kwargs) & _TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(
                f"chat_template_kwargs must not set {', '.join(taken)}: these are arguments of the "
                "template call, not template variables."
            )
        if chat_template is None and self.tokenizer.chat_template is None:
            raise ValueError("This model has no chat template; pass chat_template=... to use chat.")
        text = str(
            self.tokenizer.apply_chat_template(
                conversation,  # type: ignore[arg-type]
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,  # type: ignore[arg-type]
                **kwargs,
            )
        )
        if not is_unicode(text):
            raise ValueError("The conversation is not valid Unicode: it holds a lone surrogate.")
        return text

    def _truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: max_model_len)."""
        kept = self._kept_tokens(keep)
        return token_ids if kept is None else token_ids[-kept:]

    def _kept_tokens(self, keep: int | None) -> int | None:
        """How many tokens `truncate_prompt_tokens` keeps (-1: max_model_len), or None for all."""
        if keep is None:
            return None
        max_len = self.limits.max_model_len
        if keep > max_len:
            raise ValueError(
                f"truncate_prompt_tokens ({keep}) cannot be greater than max_model_len ({max_len}). "
                "Please select a smaller truncation size."
            )
        return max_len if keep == -1 else keep

    def _tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]  # type: ignore[typeddict-item]
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):  # not bools either
                raise ValueError("prompt_token_ids must be a list of integers.")
            return None, list(ids)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(text, str):
            if not is_unicode(text):
                raise ValueError("The prompt is not valid Unicode: it holds a lone surrogate.")
            return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        raise ValueError(
            "A prompt must be a string, {'prompt': str} or {'prompt_token_ids': list[int]}, "
            f"got {type(prompt).__name__}."
        )

    def _validate_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the logprobs bound and the vocabulary."""
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            wanted = self.limits.vocab_size if k == -1 else k
            if k is not None and wanted > self.limits.vocab_size:
                raise ValueError(f"{name}={k} is more than the vocabulary ({self.limits.vocab_size}).")
            if k is not None and self.max_logprobs != -1 and wanted > self.max_logprobs:
                raise ValueError(
                    f"{name}={k} asks for {wanted} logprobs per token; "
                    f"the maximum is {self.max_logprobs} (max_logprobs)."
                )
        vocab = self.limits.vocab_size
        for name, ids in (
            ("logit_bias", params.logit_bias or {}),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("stop_token_ids", params.stop_token_ids or []),
        ):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name} has token id {bad}, out of vocabulary (size {vocab}).")
        if params.structured_outputs is not None:  # a broken schema must not reach the core
            grammars.check(params.structured_outputs, self.tokenizer, self.grammar_limits)

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each word's tokens as it would start the text, and as a word after a space when that
        tokenizes differently into as many tokens (vLLM's rule)."""
        out: list[list[int]] = []
        for word in bad_words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            out.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return out

    def _validate_tokens(self, token_ids: list[int], room_to_generate: bool = True) -> None:
        """`room_to_generate`: the prompt must leave a token of max_model_len for generation."""
        if not token_ids:
            raise ValueError("The prompt is empty.")
        max_len = self.limits.max_model_len
        if len(token_ids) > max_len - room_to_generate:
            reason = (
                "to leave room for at least one generated token"
                if room_to_generate
                else "or truncated (truncate_prompt_tokens)"
            )
            raise ValueError(
                f"The prompt is {len(token_ids)} tokens long, but max_model_len is {max_len}: "
                f"it must be shorter, {reason}."
            )
        vocab = self.limits.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"Token id {bad} is out of vocabulary (size {vocab}).")
