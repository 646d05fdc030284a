"""The structured output backend on llguidance, as vLLM's `guidance` backend: grammars compile lazily
(no ahead-of-time automaton over the vocabulary), so compiling a schema costs little."""

from __future__ import annotations

from typing import Any, cast

import llguidance
import llguidance.hf
import torch

from llmserve.structured_output.backend import Grammar, StructuredOutputBackend


class LLGuidanceGrammar(Grammar):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, tokens: list[int]) -> bool:
        return self.matcher.consume_tokens(tokens)

    def validate_tokens(self, tokens: list[int]) -> int:
        return self.matcher.validate_tokens(tokens)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


class LLGuidanceBackend(StructuredOutputBackend):
    """`hf_tokenizer`: a fast tokenizer; `vocab_size`: the model's (the logits' width, which may exceed
    the tokenizer's); `eos_token_ids`: every token that may end a complete output."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos_token_ids
        )
        self.vocab_size = vocab_size
        self.executor = llguidance.LLExecutor()  # fills the rows of one bitmask in parallel

    def compile(self, grammar: str) -> LLGuidanceGrammar:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)  # never raises: see is_error
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return LLGuidanceGrammar(matcher)

    # llguidance.torch's helpers do the same, but importing that module costs seconds (torch.compile).
    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        words = (self.vocab_size + 31) // 32
        return torch.full((num_rows, words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())

    def fill_bitmask(self, grammars: list[Grammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous()
        matchers = [(cast(LLGuidanceGrammar, g).matcher, row) for g, row in zip(grammars, rows)]
        row_bytes = bitmask.shape[1] * 4
        self.executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
