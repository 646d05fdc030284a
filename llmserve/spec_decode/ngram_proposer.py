"""Prompt lookup: the tokens that followed an earlier occurrence of the request's last n tokens."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Finds the longest n in [min_n, max_n] for which the last n tokens occurred before (the latest
    such occurrence wins: in a rewrite it is nearest the place being copied) and proposes up to k of
    the tokens that followed it. Candidates are narrowed one token at a time from the occurrences of
    the last token, so a step costs one comparison over the tokens plus a few over the candidates."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}.")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """tokens: the request's prompt and output so far, int64 → at most k guessed next tokens."""
        last = len(tokens) - 1
        if k < 1 or last < self.min_n:
            return []
        # ends[i]: where an earlier occurrence of the last j + 1 tokens ends (before the last token)
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        found = ends if self.min_n == 1 else None
        for j in range(1, min(self.max_n, last)):
            ends = ends[ends >= j]
            ends = ends[tokens[ends - j] == tokens[last - j]]
            if not len(ends):
                break
            if j + 1 >= self.min_n:
                found = ends
        if found is None or not len(found):
            return []
        start = int(found[-1]) + 1
        return tokens[start : start + k].tolist()
