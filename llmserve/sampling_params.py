"""What to generate for one request, with vLLM's field names and validation."""

from __future__ import annotations

import enum
import itertools
import math
import re
from collections.abc import Iterable
from typing import Any

import msgspec

# Integers travel to the engine core as msgpack int64 and seed torch generators: bound them so.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# OpenAI's bound on `n`, kept offline too: each sample is a sequence in the engine.
MAX_N = 128
_SURROGATE = re.compile("[\ud800-\udfff]")


class RequestOutputKind(enum.IntEnum):
    """How much of the output each `RequestOutput` carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """vLLM's constraint on what a request may generate: exactly one of `json` (a JSON schema, as a dict
    or its text), `regex`, `choice` (one of these strings), `grammar` (Lark or EBNF) or `json_object`
    (any JSON object). JSON is compact unless `whitespace_pattern` says otherwise: a small model given
    free whitespace can emit newlines until `max_tokens`."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # True (our default): an object schema that names its properties and says nothing of others takes
    # no others, as with vLLM's default backend (xgrammar); a small model offered open objects invents
    # properties until max_tokens. False: JSON Schema's open objects (llguidance's own default).
    disable_additional_properties: bool = True
    whitespace_pattern: str | None = None  # a regex for the whitespace JSON may hold; None: compact

    def __post_init__(self) -> None:
        kinds = self._set_kinds()
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or json_object, "
                f"got {kinds or 'none'}."
            )

        if self.choice is not None and not self.choice:
            raise ValueError("structured_outputs.choice must list at least one string.")

    def _set_kinds(self) -> list[str]:
        """Set means not None, as vLLM has it (`json={}` is the schema of any JSON value), except
        `json_object`, a flag."""
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        return kinds + ["json_object"] if self.json_object else kinds

    @property
    def kind(self) -> str:
        return self._set_kinds()[0]


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Sampling settings. Invalid values raise `ValueError` naming the field.

    `temperature == 0` means greedy. `top_k == -1` (or 0) and `top_p == 1` disable those filters.
    The logits are processed in vLLM's order: `allowed_token_ids` and `bad_words` masks, then
    `min_tokens` and `logit_bias`, then the penalties, then temperature, `min_p`, top-k and top-p.
    A msgspec struct so that it travels to the engine core without pickle.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI's: minus this once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # Hugging Face's, over prompt and output: logit / p if > 0 else * p
    logit_bias: dict[int, float] | None = None  # token id → added to its logit, clamped to [-100, 100]
    bad_words: list[str] | None = None  # words never generated (their tokens, with and without a space)
    allowed_token_ids: list[int] | None = None  # when set, only these tokens can be generated
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-k logprobs per generated token (-1: the whole vocabulary)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt position (-1: the whole vocabulary)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len)
    structured_outputs: StructuredOutputsParams | None = None  # what the output must match
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self._validate()
        self._validate_logits_processing()
        if self.logit_bias:
            self.logit_bias = _clamped_bias(self.logit_bias)

    def _validate(self) -> None:
        """Every integer must fit the engine's int64 messages (msgspec, torch), every float must be
        finite and every string valid Unicode: otherwise a request fails later, inside the engine."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer from 1 to {MAX_N}, got {self.n!r}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k!r}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and (
            not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX
        ):
            raise ValueError(f"max_tokens must be an integer from 1 to 2**63 - 1, got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise ValueError(f"min_tokens must be an integer from 0 to 2**63 - 1, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})."
            )
        if any(not isinstance(s, str) or s == "" or not is_unicode(s) for s in self.stop_strings):
            raise ValueError(
                "stop must be a non-empty string or a list of non-empty strings of valid Unicode."
            )
        if not isinstance(self.stop_token_ids, list) or not all(map(_is_token_id, self.stop_token_ids)):
            raise ValueError("stop_token_ids must be a list of token ids (integers from 0 to 2**63 - 1).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not -1 <= value <= INT64_MAX):
                raise ValueError(f"{name} must be -1 (all), 0 or positive, got {value!r}.")
        if self.truncate_prompt_tokens is not None and not (
            _is_int(self.truncate_prompt_tokens)
            and (self.truncate_prompt_tokens == -1 or 1 <= self.truncate_prompt_tokens <= INT64_MAX)
        ):
            raise ValueError(
                f"truncate_prompt_tokens must be an integer >= 1 or -1, got {self.truncate_prompt_tokens!r}."
            )
        if self.seed is not None and (not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed!r}.")

    def _validate_logits_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}.")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and _are_token_ids(self.logit_bias)
            and _are_numbers(self.logit_bias.values())
        ):
            raise ValueError(
                "logit_bias must map token ids (integers from 0 to 2**63 - 1) to numbers (not NaN)."
            )
        if self.bad_words is not None and not (
            isinstance(self.bad_words, list)
            and all(isinstance(w, str) and w.strip() and is_unicode(w) for w in self.bad_words)
        ):
            raise ValueError(
                "bad_words must be a list of strings of valid Unicode that are not empty or only whitespace."
            )
        if self.allowed_token_ids is not None and not (
            isinstance(self.allowed_token_ids, list)
            and self.allowed_token_ids
            and all(map(_is_token_id, self.allowed_token_ids))
        ):
            raise ValueError(
                "allowed_token_ids must be a non-empty list of token ids (integers from 0 to 2**63 - 1)."
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (used to fan out n > 1 into child requests)."""
        return msgspec.structs.replace(self, **changes)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# A logit_bias may name every token of the vocabulary, and each of n > 1 children decodes it again in the
# engine core: the checks below run per element in C (map, set, min, max), not in Python bytecode.


def _are_token_ids(values: Iterable[object]) -> bool:
    values = list(values)
    ints = all(map(isinstance, values, itertools.repeat(int))) and not any(
        map(isinstance, values, itertools.repeat(bool))
    )
    return not values or (ints and min(values) >= 0 and max(values) <= INT64_MAX)  # type: ignore[type-var,operator]


def _are_numbers(values: Iterable[object]) -> bool:
    values = list(values)
    numbers = all(map(isinstance, values, itertools.repeat((int, float)))) and not any(
        map(isinstance, values, itertools.repeat(bool))
    )
    return numbers and not any(map(math.isnan, values))  # type: ignore[arg-type]


def _clamped_bias(bias: dict[int, float]) -> dict[int, float]:
    """Floats in [-100, 100] (OpenAI's range); the same dict when it already is."""
    values = bias.values()
    if set(map(type, values)) == {float} and min(values) >= -100.0 and max(values) <= 100.0:
        return bias
    clamped = map(min, map(max, map(float, values), itertools.repeat(-100.0)), itertools.repeat(100.0))
    return dict(zip(bias, clamped))


def _is_token_id(value: object) -> bool:
    """Non-negative and int64; the vocabulary bound is the `InputProcessor`'s to check."""
    return _is_int(value) and 0 <= value <= INT64_MAX  # type: ignore[operator]


def is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON's `"\\ud800"`), which no tokenizer encodes."""
    return _SURROGATE.search(text) is None
