"""argmax.c against torch.argmax(dim=-1) under every instruction-set build this CPU runs: the same index
exactly, on the rows where a vector kernel could go wrong (ties across lanes, NaNs, lengths not a
multiple of the vector, rows shorter than one)."""

from __future__ import annotations

import pytest
import torch

from llmserve.model_executor.kernels import native


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 100, 1024, 4099])
def test_random_rows_match_torch(isa: str, n: int) -> None:
    x = torch.randn(9, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1))


def test_ties_nans_and_infinities_match_torch(isa: str) -> None:
    n = 203  # 12 vectors of 16, 25 of 8, and a tail
    rows = []
    for a, b in [(3, 200), (200, 3), (17, 33), (33, 17), (5, 6), (190, 202)]:
        row = torch.randn(n, generator=torch.Generator().manual_seed(a * n + b))
        row[a] = row[b] = 9.0  # the first of two equal maxima, in any lanes
        rows.append(row)
    for at in [0, 15, 16, 101, 200, 202]:
        row = torch.randn(n, generator=torch.Generator().manual_seed(at))
        row[at] = float("nan")
        row[(at + 50) % n] = float("nan")  # the first NaN wins, even before the maximum
        row[(at + 7) % n] = float("inf")
        rows.append(row)
    rows.append(torch.full((n,), float("-inf")))  # all equal: index 0
    rows.append(torch.full((n,), 2.5))
    row = torch.full((n,), float("-inf"))
    row[150] = -1e30
    rows.append(row)
    x = torch.stack(rows)
    assert torch.equal(native.argmax_rows(x), x.argmax(dim=-1))


def test_refuses_what_it_cannot_read(isa: str) -> None:
    with pytest.raises(ValueError, match="float32"):
        native.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="1 to"):
        native.argmax_rows(torch.zeros(2, 0))
