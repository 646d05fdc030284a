"""What to generate for one request, with vLLM's field names and validation."""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class RequestOutputKind(enum.IntEnum):
    """How much of the output each `RequestOutput` carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """Sampling settings. Invalid values raise `ValueError` naming the field.

    `temperature == 0` means greedy. `top_k == -1` (or 0) and `top_p == 1` disable those filters.
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
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-k logprobs per generated token (-1: the whole vocabulary)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})."
            )
        if any(not isinstance(s, str) or s == "" for s in self.stop_strings):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise ValueError("stop_token_ids must be a list of non-negative integers.")
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be -1 (all), 0 or positive, got {self.logprobs}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def clone(self, **changes: Any) -> SamplingParams:
        """A copy with some fields changed (used to fan out n > 1 into child requests)."""
        return msgspec.structs.replace(self, **changes)
