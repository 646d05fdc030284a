"""Comparing two greedy runs of our engine under the near-tie rule (both carry logprobs, k >= 2)."""

from __future__ import annotations

from llmserve.outputs import CompletionOutput

TIE_TOLERANCE = 1e-3


def top2(output: CompletionOutput, position: int) -> dict[int, float]:
    assert output.logprobs is not None
    return {t: lp.logprob for t, lp in output.logprobs[position].items() if (lp.rank or 3) <= 2}


def assert_same_greedy(a: CompletionOutput, b: CompletionOutput) -> str | None:
    """Equal token ids, or equal up to a first divergence that is a near-tie on both sides."""
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x == y:
            continue
        ta, tb = top2(a, i), top2(b, i)
        tie = (
            {x, y} <= set(ta)
            and {x, y} <= set(tb)
            and abs(ta[x] - ta[y]) < TIE_TOLERANCE
            and abs(tb[x] - tb[y]) < TIE_TOLERANCE
        )
        assert tie, f"token {i} differs: {x} vs {y}; top 2: {ta} / {tb}"
        return f"near-tie at token {i}"
    assert a.token_ids == b.token_ids
    return None
