"""A request's grammar as the scheduler sees it: compiling, then compiled (or failed)."""

from __future__ import annotations

from concurrent.futures import Future

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured_output.backend import Grammar


class StructuredOutputRequest:
    """`future` is set when the manager starts compiling; `grammar` once it is done."""

    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        self.future: Future[Grammar] | None = None
        self.grammar: Grammar | None = None

    def is_ready(self) -> bool:
        """True once compiled; re-raises the compile error (a `ValueError`) when it failed."""
        if self.grammar is None:
            if self.future is None or not self.future.done():
                return False
            self.grammar = self.future.result()
        return True
