"""The engine core's structured outputs: compiles grammars in a thread pool and fills each step's bitmask.

The core has no tokenizer until the first structured request: the backend (the tokenizer, llguidance's
view of it) is built then, in the pool, so neither start-up nor the other requests wait for it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import threading
from collections.abc import Mapping

import torch

from llmserve.contracts import ScheduledRequest
from llmserve.model_executor.loader import ModelSource
from llmserve.model_executor.loader.tokenizer import eos_token_ids, load_tokenizer
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.scheduling.request import Request
from llmserve.structured_output.backend import Grammar, StructuredOutputBackend
from llmserve.structured_output.bitmask import GrammarBitmask
from llmserve.structured_output.grammar_threads import LargeStackExecutor
from llmserve.structured_output.grammars import to_grammar


class StructuredOutputManager:
    """`max_num_seqs` bounds the rows of one step's bitmask."""

    def __init__(self, source: ModelSource, vocab_size: int, max_num_seqs: int) -> None:
        self.source = source
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None
        # large stacks: llguidance compiles recursively (grammar_threads.py)
        self._pool = LargeStackExecutor(max(1, (os.cpu_count() or 2) // 2), "GrammarCompile")
        self._compiling: set[concurrent.futures.Future[Grammar]] = set()

    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar; the scheduler admits it once `is_ready()`."""
        assert request.structured_output is not None
        future = self._pool.submit(self._compile, request.structured_output.params)
        request.structured_output.future = future
        self._compiling.add(future)
        future.add_done_callback(self._compiling.discard)

    def _compile(self, params: StructuredOutputsParams) -> Grammar:
        return self._get_backend().compile(to_grammar(params))

    def _get_backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self.backend is None:
                # llguidance.hf imports transformers (about a second): only once a request needs it
                from llmserve.structured_output.llguidance_backend import LLGuidanceBackend

                tokenizer = load_tokenizer(self.source)
                self.backend = LLGuidanceBackend(
                    tokenizer, self.vocab_size, eos_token_ids(self.source, tokenizer)
                )
            return self.backend

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a grammar being compiled is done (or `timeout` s): for a step that had nothing
        to run but requests waiting for their grammars, instead of spinning."""
        if self._compiling:
            concurrent.futures.wait(
                list(self._compiling), timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def grammar_bitmask(
        self, scheduled: list[ScheduledRequest], requests: Mapping[str, Request]
    ) -> GrammarBitmask | None:
        """The bitmask for this step's sampling requests that have a grammar; None when there are none
        (before the first structured request this costs one attribute check). A request with guesses
        gets a row per guess and one after them: its grammar advances over the guesses as it fills
        them, then rolls back. `Speculator.propose` checked that the grammar takes every guess and that none
        follows the one that completes it (a matcher stepped past its end, or over a token it refuses,
        would stay in its error state after the rollback). `requests`: the scheduler's, by id."""
        if self.backend is None:
            return None
        ids: list[str] = []
        grammars: list[Grammar] = []
        guesses: list[list[int]] = []
        for sched in scheduled:
            structured = requests[sched.request_id].structured_output
            if sched.samples and structured is not None and structured.grammar is not None:
                ids.append(sched.request_id)
                grammars.append(structured.grammar)
                guesses.append(sched.spec_token_ids)
        if not grammars:
            return None
        num_rows = [1 + len(g) for g in guesses]
        total = sum(num_rows)
        if self._bitmask is None or self._bitmask.shape[0] < total:
            self._bitmask = self.backend.allocate_bitmask(max(total, self.max_num_seqs))
        starts = list(itertools.accumulate(num_rows, initial=0))
        self.backend.fill_bitmask(grammars, self._bitmask, starts[:-1])
        for j in range(1, max(num_rows)):  # row j of each request with j guesses or more
            ahead = [i for i, g in enumerate(guesses) if len(g) >= j]
            for i in ahead:
                grammars[i].accept_tokens([guesses[i][j - 1]])
            self.backend.fill_bitmask(
                [grammars[i] for i in ahead], self._bitmask, [starts[i] + j for i in ahead]
            )
        for grammar, g in zip(grammars, guesses):
            if g:
                grammar.rollback(len(g))
        return GrammarBitmask(ids, num_rows, self._bitmask[:total])
