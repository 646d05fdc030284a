"""What the engine core needs of a grammar library: compile a grammar, fill token bitmasks, advance."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Grammar(ABC):
    """One request's matcher: the state after the output tokens it accepted so far."""

    @abstractmethod
    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance over `tokens`; False (and `error` says why) when the grammar rejects one."""

    @abstractmethod
    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, the grammar would accept next; the state is unchanged."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and nothing but EOS may follow."""

    @property
    @abstractmethod
    def error(self) -> str:
        """Why the matcher is in its error state; empty when it is not."""


class StructuredOutputBackend(ABC):
    """Compiles `grammars.to_grammar` texts for one tokenizer. Bitmasks are int32 `[rows, words]`
    on the CPU, bit `t % 32` of word `t // 32` set when token `t` may come next."""

    @abstractmethod
    def compile(self, grammar: str) -> Grammar:
        """Raises `ValueError` naming the problem when `grammar` does not compile. Thread-safe."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> torch.Tensor: ...

    @abstractmethod
    def fill_bitmask(self, grammars: list[Grammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Row `rows[i]` of `bitmask` := the tokens `grammars[i]` allows next (EOS only where it is
        complete)."""
