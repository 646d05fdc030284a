from __future__ import annotations

import numpy as np
import pytest

from llmserve.spec_decode.ngram_proposer import NgramProposer


def propose(tokens: list[int], k: int, min_n: int = 1, max_n: int = 3) -> list[int]:
    return NgramProposer(min_n, max_n).propose(np.array(tokens, dtype=np.int64), k)


def test_proposes_what_followed_the_longest_match() -> None:
    # The last 3 tokens (1 2 3) occurred once, followed by 9 8; the last 1 or 2 also after that.
    tokens = [1, 2, 3, 9, 8, 5, 2, 3, 7, 7, 1, 2, 3]
    assert propose(tokens, 2) == [9, 8]
    assert propose(tokens, 1, max_n=2) == [7]  # "2 3" last occurred before 7


def test_latest_occurrence_of_the_longest_match_wins() -> None:
    tokens = [4, 5, 6, 1, 4, 5, 7, 2, 4, 5]
    assert propose(tokens, 2, max_n=2) == [7, 2]


def test_no_match_of_at_least_min_n_tokens_proposes_nothing() -> None:
    tokens = [1, 2, 3, 4, 9, 3, 4]
    assert propose(tokens, 3, min_n=2) == [9, 3, 4]  # "3 4" matched: 2 tokens
    assert propose(tokens, 3, min_n=3) == []  # "9 3 4" never occurred before
    assert propose([1, 2, 3], 3) == []


def test_proposals_stop_at_the_end_of_the_tokens_and_at_k() -> None:
    # "7 7" repeats: the latest earlier "7 7" ends one before the last token, so one token follows it
    assert propose([5, 7, 7, 7], 4, max_n=2) == [7]
    assert propose([1, 2, 3, 4, 5, 1, 2], 2) == [3, 4]
    assert propose([1, 2, 3, 4, 5, 1, 2], 0) == []


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        NgramProposer(3, 2)
    with pytest.raises(ValueError):
        NgramProposer(0, 2)
