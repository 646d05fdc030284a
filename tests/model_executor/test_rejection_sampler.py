"""A row with a guess samples from the same distribution as a row without (chi-square over many rows)."""

from __future__ import annotations

import torch

from llmserve.model_executor.sampler import SamplingMetadata, sample

PROBS = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
ROWS = 200_000
# chi-square critical value for 5 degrees of freedom at p = 0.001: a correct sampler fails 1 run in 1000
# (the seed is fixed, so this run either always passes or never)
CRITICAL_DF5 = 20.52


def metadata(rows: int, temperature: float = 1.0, generators: dict[int, torch.Generator] | None = None,
             top_k: int | None = None) -> SamplingMetadata:  # fmt: skip
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        all_greedy=temperature == 0.0,
        top_k=None if top_k is None else torch.full((rows,), top_k, dtype=torch.int64),
        top_p=None,
        min_p=None,
        generators=generators or {},
    )


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


def test_a_guessed_row_keeps_the_distribution_and_differs_from_the_guess_exactly_when_rejected() -> None:
    torch.manual_seed(0)
    logits = PROBS.log().expand(ROWS, -1).contiguous()
    for guess in (1, 5):  # a likely and an unlikely guess
        drafts = torch.full((ROWS,), guess)
        tokens = sample(logits, metadata(ROWS), drafts)
        assert chi_square(tokens, PROBS) < CRITICAL_DF5
        kept = (tokens == guess).double().mean().item()
        assert abs(kept - PROBS[guess].item()) < 0.005  # kept with probability p(guess)
    # without a guess the same rows draw from the same distribution
    assert chi_square(sample(logits, metadata(ROWS)), PROBS) < CRITICAL_DF5


def test_a_guess_outside_top_k_is_never_kept() -> None:
    torch.manual_seed(1)
    logits = PROBS.log().expand(10_000, -1).contiguous()
    tokens = sample(logits, metadata(10_000, top_k=2), torch.full((10_000,), 2))
    assert set(tokens.tolist()) == {1, 3}  # the two likeliest


def test_greedy_rows_take_the_argmax_whatever_the_guess() -> None:
    logits = PROBS.log().expand(4, -1).contiguous()
    tokens = sample(logits, metadata(4, temperature=0.0), torch.tensor([1, 2, -1, 4]))
    assert tokens.tolist() == [1, 1, 1, 1]


def test_seeded_rows_repeat_with_their_generator() -> None:
    logits = PROBS.log().expand(3, -1).contiguous()
    drafts = torch.tensor([2, 3, -1])

    def run() -> list[int]:
        generator = torch.Generator().manual_seed(7)
        torch.manual_seed(torch.seed())  # the unseeded rows' noise differs between runs
        return sample(
            logits, metadata(3, generators={0: generator, 1: generator, 2: generator}), drafts
        ).tolist()

    assert all(run() == run() for _ in range(5))
