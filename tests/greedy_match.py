"""The one rule by which a greedy run is compared with a reference (Hugging Face, or another run of ours).

Every token must match, with one exception per sequence: a near-tie, a position where the reference's
top-1 and top-2 logprobs are less than NEAR_TIE_NATS apart and we chose its second token. Summation order
alone can flip such a choice, and the two sequences part there. The comparison does not stop at the
near-tie: it goes on along the reference's tokens, and our greedy choice at each later position, given the
prompt and the reference's tokens before it (one prefill with prompt logprobs), must be the reference's
token. A reference forced along our tokens (transformers' choice at each position given ours before it)
goes on along ours instead. A second difference anywhere fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llmserve import LLM, SamplingParams
from llmserve.outputs import CompletionOutput, RequestOutput

NEAR_TIE_NATS = 1e-3


@dataclass(frozen=True)
class Top2:
    """The reference's two most likely tokens at one position, with their logprobs."""

    first: int
    first_logprob: float
    second: int
    second_logprob: float


def top2_of(output: CompletionOutput, position: int) -> Top2:
    """Read from a run of ours that carried logprobs with k >= 2."""
    assert output.logprobs is not None, "the reference run needs logprobs >= 2"
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in output.logprobs[position].items() if lp.rank)
    (_, first, first_lp), (_, second, second_lp) = ranked[:2]
    return Top2(first, first_lp, second, second_lp)


def our_choices_along(llm: LLM, prompt_ids: Sequence[int], forced: Sequence[int]) -> list[int]:
    """Our greedy choice at each position of `forced`, given the prompt and `forced` before it."""
    ids = list(prompt_ids) + list(forced)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    entries = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].prompt_logprobs
    assert entries is not None
    choices = []
    for entry in entries[len(prompt_ids) :]:
        assert entry is not None
        choices.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return choices


def assert_greedy_match(
    ours: Sequence[int],
    reference: Sequence[int],
    top2: Callable[[int], Top2],
    ours_along_reference: Callable[[], Sequence[int]],
    near_tie: float = NEAR_TIE_NATS,
) -> int | None:
    """Assert the rule above; return the near-tie's position, or None when every token matched.

    `top2(i)` gives the reference's top two at position i; `ours_along_reference()` gives our choices
    teacher-forced on the reference's tokens, or our own tokens where the reference was forced along them
    (called only after a near-tie); `near_tie` is wider where the runs round differently (bf16)."""
    assert len(ours) == len(reference), f"lengths differ: ours {len(ours)}, reference {len(reference)}"
    tie = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
    if tie is None:
        return None
    ref = top2(tie)
    margin = ref.first_logprob - ref.second_logprob
    assert ref.first == reference[tie] and ours[tie] == ref.second and margin < near_tie, (
        f"token {tie} differs: ours {ours[tie]}, reference {reference[tie]}; the reference's top 2 are "
        f"{ref}, a margin of {margin:.2e} nats (a near-tie needs < {near_tie})"
    )
    along = list(ours_along_reference())
    later = [j for j in range(tie + 1, len(reference)) if along[j] != reference[j]]
    assert not later, (
        f"after the near-tie at token {tie}, ours and the reference's choices differ at {later}: "
        f"ours {[along[j] for j in later]}, reference {[reference[j] for j in later]}"
    )
    return tie


def assert_same_greedy(
    llm: LLM, ours: RequestOutput, reference: RequestOutput, near_tie: float = NEAR_TIE_NATS
) -> int | None:
    """Two greedy runs of our engine (both with logprobs >= 2); `llm` continues along the reference's
    tokens after a near-tie."""
    a, b = ours.outputs[0], reference.outputs[0]
    return assert_greedy_match(
        a.token_ids,
        b.token_ids,
        lambda i: top2_of(b, i),
        lambda: our_choices_along(llm, reference.prompt_token_ids, b.token_ids),
        near_tie,
    )
