"""The comparison rule itself fails where it should: a rule that cannot fail proves nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve import LLM
from tests.engine.test_llm_batching import greedy, make_llm, random_prompts
from tests.greedy_match import NEAR_TIE_NATS, Top2, assert_greedy_match, our_choices_along

REFERENCE = [5, 6, 7, 8, 9]


def top2_with_margin(margin: float) -> Top2:
    return Top2(first=7, first_logprob=-1.0, second=70, second_logprob=-1.0 - margin)


def compare(ours: list[int], margin: float, along: list[int]) -> int | None:
    return assert_greedy_match(ours, REFERENCE, lambda i: top2_with_margin(margin), lambda: along)


def test_equal_sequences_have_no_tie() -> None:
    assert compare(REFERENCE, 0.5, along=[]) is None  # `along` is never asked for


def test_a_near_tie_is_allowed_once_and_the_comparison_goes_on() -> None:
    assert compare([5, 6, 70, 1, 2], NEAR_TIE_NATS / 2, along=REFERENCE) == 2
    with pytest.raises(AssertionError, match=r"differ at \[4\]"):
        compare([5, 6, 70, 1, 2], NEAR_TIE_NATS / 2, along=[5, 6, 70, 8, 3])


def test_a_difference_that_is_no_near_tie_fails() -> None:
    with pytest.raises(AssertionError, match="token 2 differs"):
        compare([5, 6, 70, 8, 9], 2 * NEAR_TIE_NATS, along=REFERENCE)
    with pytest.raises(AssertionError, match="token 2 differs"):
        compare([5, 6, 71, 8, 9], NEAR_TIE_NATS / 2, along=REFERENCE)  # not the reference's second
    with pytest.raises(AssertionError, match="lengths differ"):
        compare(REFERENCE[:4], 0.5, along=REFERENCE)


@pytest.fixture(scope="module")
def llm(tiny_llama_hf_dir: Path) -> Iterator[LLM]:
    engine = make_llm(tiny_llama_hf_dir)
    yield engine
    engine.shutdown()


def test_our_choices_along_a_sequence_are_our_greedy_tokens(llm: LLM) -> None:
    """Teacher forcing through prompt logprobs, along our own greedy output, gives that output back;
    along a sequence that is not ours, it gives our choice at each position."""
    prompt = random_prompts(1, 30, 30, seed=8)[0]["prompt_token_ids"]
    generated = llm.generate({"prompt_token_ids": prompt}, greedy(12), use_tqdm=False)[0].outputs[0]
    assert our_choices_along(llm, prompt, generated.token_ids) == generated.token_ids
    other = [3] + list(generated.token_ids[1:])
    choices = our_choices_along(llm, prompt, other)
    assert choices[0] == generated.token_ids[0]
    forced = llm.generate({"prompt_token_ids": prompt + [3]}, greedy(1), use_tqdm=False)[0].outputs[0]
    assert choices[1] == forced.token_ids[0]
