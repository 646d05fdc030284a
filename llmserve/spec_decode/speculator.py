"""The scheduler's side of speculative decoding: which requests guess this step, what, and how it went."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from llmserve.config import SpeculativeConfig
from llmserve.contracts import SpecDecodingStats
from llmserve.model_executor.logits_processors import reads_history
from llmserve.scheduling.request import Request
from llmserve.spec_decode.ngram_proposer import NgramProposer
from llmserve.structured_output.backend import Grammar

# A request whose last _WINDOW drafted steps accepted fewer than _MIN_ACCEPTED tokens per drafted step
# stops guessing for _PAUSE generated tokens, twice as long each time it stops again: a checked guess
# costs a step of 1 + k rows instead of 1, which only accepted tokens repay.
_WINDOW = 4
_MIN_ACCEPTED = 0.5
_PAUSE = 16
_MAX_PAUSE = 512


@dataclass
class _RequestState:
    tokens: np.ndarray  # the request's tokens (a prefix of its capacity holds them)
    length: int
    recent: list[int] = field(default_factory=list)  # accepted tokens of its last drafted steps
    paused_until: int = 0  # its output length at which it may guess again
    pause: int = _PAUSE


class Speculator:
    """Owned by the scheduler: proposes each step's guesses for a request (`propose`), learns how they
    fared (`record`), and counts them for /metrics (`stats`, cumulative, as vLLM's counters)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecDecodingStats(num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self._requests: dict[str, _RequestState] = {}

    def speculates(self, num_running: int) -> bool:
        """Whether a step of this many running requests guesses at all."""
        return num_running <= self.config.speculating_batch_size

    def propose(self, request: Request, budget: int) -> list[int]:
        """Guesses for the request's next tokens, to be checked after its last one: at most `budget`, and
        never more than it may still generate after the token the check itself adds."""
        if not self._eligible(request):
            return []
        k = min(
            self.config.num_speculative_tokens, budget, request.max_tokens - request.num_output_tokens - 1
        )
        state = self._state(request)
        if k < 1 or request.num_output_tokens < state.paused_until:
            return []
        guesses = self.proposer.propose(state.tokens[: state.length], k)
        grammar = request.structured_output.grammar if request.structured_output else None
        if grammar is not None and guesses:
            guesses = guesses[: _num_grammatical(grammar, guesses)]
        return guesses

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A drafted step's outcome: `num_accepted` of its `num_drafts` guesses were right."""
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            stats.num_accepted_tokens_per_pos[i] += 1
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.recent = [*state.recent[-(_WINDOW - 1) :], num_accepted]
        if len(state.recent) == _WINDOW and sum(state.recent) < _MIN_ACCEPTED * _WINDOW:
            state.paused_until = request.num_output_tokens + state.pause
            state.pause = min(2 * state.pause, _MAX_PAUSE)
            state.recent = []

    def snapshot(self) -> SpecDecodingStats:
        """A copy of the totals, for the step's stats (which leave while these keep counting)."""
        stats = self.stats
        return SpecDecodingStats(
            stats.num_drafts,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            list(stats.num_accepted_tokens_per_pos),
        )

    def free(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _eligible(self, request: Request) -> bool:
        """Requests whose every row is sampled from the same processing as without guesses: none whose
        logits processing reads the tokens before the row (penalties, bad words, min_tokens)."""
        return request.pooling_params is None and not reads_history(request)

    def _state(self, request: Request) -> _RequestState:
        """The request's tokens as an array, extended by those it gained since the last step."""
        state = self._requests.get(request.request_id)
        n = request.num_tokens
        if state is None:
            state = _RequestState(np.empty(max(2 * n, 64), dtype=np.int64), 0)
            self._requests[request.request_id] = state
        if n > len(state.tokens):
            grown = np.empty(min(max(2 * len(state.tokens), n), max(self.max_model_len, n)), dtype=np.int64)
            grown[: state.length] = state.tokens[: state.length]
            state.tokens = grown
        if n > state.length:
            state.tokens[state.length : n] = request.all_token_ids[state.length : n]
            state.length = n
        return state


def _num_grammatical(grammar: Grammar, guesses: list[int]) -> int:
    """How many of the guesses the grammar takes, up to the one that completes it: after that the
    request stops (only EOS, which ends it, would be allowed), so a later guess would be wasted, and
    the matcher must not be advanced past its end while the step's bitmask rows are filled."""
    n = 0
    for token in guesses[: grammar.validate_tokens(guesses)]:
        if grammar.is_terminated():
            break
        grammar.accept_tokens([token])
        n += 1
    grammar.rollback(n)
    return n
