"""The sampler against the exact distributions it should draw from, and seeded rows across batches.

For each setting, many identical rows of fixed logits are sampled in one call and the token counts
are compared with a reference computed here in fp64 from the definitions, in vLLM's order:
temperature, then min-p, then top-k, then top-p on what top-k left. Pearson's chi-square at a
Bonferroni level keeps the module's false-failure rate below 1e-6; every check also shows it would
reject near misses (temperature ×1.1, one token too many, the filters in another order).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import pytest
import torch

from llmserve.model_executor.sampler import SamplingMetadata, sample

# Distinct logits, shuffled so that the most likely token is not the first or the last id.
LOGITS = torch.tensor([1.5, -0.3, 0.6, 2.1, -1.0, 1.0, 0.1, -1.4], dtype=torch.float64)
VOCAB = LOGITS.numel()
ROWS = 200_000
FILTERS = ("min_p", "top_k", "top_p")  # vLLM's order, after temperature


@dataclass(frozen=True)
class Case:
    """One row's settings, with the sampling-params conventions: top_k 0, top_p 1, min_p 0 disable."""

    name: str
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def uses(self, name: str) -> bool:
        """Whether the filter `name` is switched on."""
        return {"min_p": self.min_p > 0, "top_k": self.top_k > 0, "top_p": self.top_p < 1}[name]


CASES = [
    Case("temperature 1"),
    Case("temperature 0.7", temperature=0.7),
    Case("temperature 1.8", temperature=1.8),
    Case("top-k 3", top_k=3),
    Case("top-p 0.75", top_p=0.75),
    Case("min-p 0.2", min_p=0.2),
    Case("temperature, top-k, top-p", temperature=1.8, top_k=5, top_p=0.8),
    Case("temperature, min-p, top-p", temperature=1.5, top_p=0.8, min_p=0.15),
    Case("temperature, min-p, top-k", temperature=1.5, top_k=4, min_p=0.15),
    Case("all four", temperature=1.5, top_k=5, top_p=0.85, min_p=0.15),
]
BY_NAME = {case.name: case for case in CASES}
GREEDY = Case("greedy", temperature=0.0)
MIXED = [BY_NAME["all four"], BY_NAME["top-k 3"], GREEDY, Case("temperature 0.7, min-p 0.2", 0.7, min_p=0.2)]
NUM_CHECKS = len(CASES) + len(MIXED) + 1  # + the seeded rows
# 1e-7 rather than 1e-6 leaves a factor 10 for the chi-square approximation's tail, with every
# expected count at least MIN_EXPECTED.
ALPHA = 1e-7 / NUM_CHECKS
MIN_EXPECTED = 500


# ---- the reference, in fp64 from the definitions ----


def _filtered(probs: torch.Tensor, name: str, case: Case) -> torch.Tensor:
    """Zero the tokens one filter removes from `probs` (which sum to 1 over the tokens still kept)."""
    if not case.uses(name):
        return probs
    if name == "min_p":
        return torch.where(probs >= case.min_p * probs.max(), probs, 0.0)
    if name == "top_k":
        keep = probs.argsort(descending=True)[: case.top_k]
        return torch.zeros_like(probs).index_copy(0, keep, probs[keep])
    if name == "top_p":
        # The smallest set of most likely tokens whose mass reaches top_p.
        ordered, order = probs.sort(descending=True)
        count = int((ordered.cumsum(0) < case.top_p).sum()) + 1
        keep = order[:count]
        return torch.zeros_like(probs).index_copy(0, keep, probs[keep])
    return probs


def reference(case: Case, order: tuple[str, ...] = FILTERS, temperature_first: bool = True) -> torch.Tensor:
    """[vocab] fp64 probabilities of each token; other orders exist only to show the test's power."""
    probs = torch.softmax(LOGITS / (case.temperature if temperature_first else 1.0), 0)
    for name in order:
        probs = _filtered(probs, name, case)
        probs = probs / probs.sum()
    if not temperature_first:
        probs = torch.where(probs > 0, probs ** (1 / case.temperature), 0.0)
    return probs / probs.sum()


def widened(case: Case) -> torch.Tensor:
    """The right distribution with one token too many: an off-by-one at any filter's boundary."""
    probs = torch.softmax(LOGITS / case.temperature, 0)
    kept = reference(case) > 0
    kept[torch.where(kept, -1.0, probs).argmax()] = True
    return torch.where(kept, probs, 0.0) / probs[kept].sum()


def near_misses(case: Case) -> dict[str, torch.Tensor]:
    """Distributions a subtly wrong sampler would draw from, each different from the right one."""
    right = reference(case)
    misses = {"temperature x1.1": reference(replace(case, temperature=case.temperature * 1.1))}
    if (right == 0).any():
        misses["one token too many"] = widened(case)
    for order in itertools.permutations(FILTERS):
        for temperature_first in (True, False):
            other = reference(case, order, temperature_first)
            if (other - right).abs().max() > 1e-9:
                misses[f"{' → '.join(order)}, temperature {'first' if temperature_first else 'last'}"] = other
    return misses


# ---- chi-square ----


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), exact for integer df: Q(x; 1) = erfc(sqrt(x/2)),
    Q(x; 2) = exp(-x/2), and Q(x; k+2) = Q(x; k) + (x/2)^(k/2) exp(-x/2) / Gamma(k/2 + 1)."""
    if df == 0 or x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    k = 1 if df % 2 else 2
    q = math.erfc(math.sqrt(x / 2)) if k == 1 else math.exp(-x / 2)
    while k < df:
        q += math.exp(k / 2 * math.log(x / 2) - x / 2 - math.lgamma(k / 2 + 1))
        k += 2
    return q


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit over the tokens `probs` allows; 0 if a forbidden token was drawn."""
    allowed = probs > 0
    if counts[~allowed].any():
        return 0.0
    expected = counts.sum() * probs[allowed]
    statistic = float(((counts[allowed] - expected) ** 2 / expected).sum())
    return chi2_sf(statistic, int(allowed.sum()) - 1)


def test_chi2_sf_matches_known_critical_values() -> None:
    """Quantiles at 1 - 1e-6 from tables (df 1 from the normal: P(|Z| > 4.8916) = 1e-6)."""
    for df, critical in [(1, 4.891638**2), (2, -2 * math.log(1e-6)), (5, 35.888), (7, 40.522)]:
        assert chi2_sf(critical, df) == pytest.approx(1e-6, rel=1e-3)
    assert chi2_sf(0.0, 3) == 1.0 and chi2_sf(float("inf"), 3) == 0.0


# ---- sampling ----


def metadata(
    rows: list[Case], vocab: int = VOCAB, generators: dict[int, torch.Generator] | None = None
) -> SamplingMetadata:
    """As the model runner builds it: neutral values where a row does not use a filter that another
    row uses, None where no row uses it."""

    def column(values: list[float], neutral: float, dtype: torch.dtype) -> torch.Tensor | None:
        return None if all(v == neutral for v in values) else torch.tensor(values, dtype=dtype)

    return SamplingMetadata(
        temperature=torch.tensor([r.temperature for r in rows], dtype=torch.float32),
        all_greedy=all(r.temperature == 0 for r in rows),
        top_k=column([r.top_k if r.top_k > 0 else vocab for r in rows], vocab, torch.int64),
        top_p=column([r.top_p for r in rows], 1.0, torch.float32),
        min_p=column([r.min_p for r in rows], 0.0, torch.float32),
        generators=generators or {},
    )


def draw(rows: list[Case], seed: int, generators: dict[int, torch.Generator] | None = None) -> torch.Tensor:
    """One sampler call on identical rows of LOGITS; a fixed global seed, restored afterwards."""
    logits = LOGITS.float().expand(len(rows), VOCAB).contiguous()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return sample(logits, metadata(rows, VOCAB, generators))


def assert_follows(tokens: torch.Tensor, case: Case) -> None:
    """The tokens fit the reference, never hit a filtered token, and would not fit a near miss."""
    expected = reference(case)
    assert tokens.numel() * expected[expected > 0].min() >= MIN_EXPECTED, "too few rows for chi-square"
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    assert not counts[expected == 0].any(), f"{case.name}: sampled filtered tokens {counts.tolist()}"
    p = p_value(counts, expected)
    assert p > ALPHA, f"{case.name}: p = {p:.3g}, counts {counts.tolist()}, expected {expected.tolist()}"
    for miss, wrong in near_misses(case).items():
        assert p_value(counts, wrong) < ALPHA, f"{case.name}: cannot tell the sampler from '{miss}'"


def unambiguous(case: Case, delta: float = 1e-3) -> bool:
    """Moving top-p or min-p by `delta` keeps the same tokens, so fp32 rounding cannot flip a boundary."""
    kept = reference(case) > 0
    for step in (-delta, delta):
        nudged = replace(case, top_p=min(case.top_p + step, 1.0), min_p=max(case.min_p + step, 0.0))
        if not torch.equal(reference(nudged) > 0, kept):
            return False
    return True


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_samples_follow_the_exact_distribution(case: Case) -> None:
    """200,000 identical rows in one call: the counts fit the reference and no near miss."""
    assert unambiguous(case), f"{case.name}: a boundary is too close"
    assert_follows(draw([case] * ROWS, seed=CASES.index(case)), case)


def test_combined_cases_exercise_every_filter_and_the_order() -> None:
    """Each filter of a combination removes tokens, and where top-p is in, another filter order
    (temperature still first) gives another distribution, so the checks above pin vLLM's order."""
    combined = [c for c in CASES if sum(map(c.uses, FILTERS)) >= 2]
    assert len(combined) == 4
    for case in combined:
        probs = torch.softmax(LOGITS / case.temperature, 0)
        for name in filter(case.uses, FILTERS):
            after = _filtered(probs, name, case)
            assert (after > 0).sum() < (probs > 0).sum(), f"{case.name}: {name} removes nothing"
            probs = after / after.sum()
        if case.uses("top_p"):
            assert any("temperature first" in miss for miss in near_misses(case)), case.name


@pytest.mark.parametrize("name", FILTERS)
def test_the_kept_tokens_match_the_definition_at_every_threshold(name: str) -> None:
    """A sweep of one filter's setting (steps of 0.01, or every k) in one batch of 2,000 rows a value:
    exactly the tokens the definition keeps are drawn, so a boundary moved by 0.01 shows. Every kept
    token has probability above 0.012, so one goes undrawn with probability below e^-25 (the whole
    sweep below 1e-7)."""
    grid = {
        "top_k": [Case(f"top-k {k}", top_k=k) for k in range(1, VOCAB + 1)],
        "top_p": [Case(f"top-p {i / 100}", top_p=i / 100) for i in range(1, 101)],
        "min_p": [Case(f"min-p {i / 100}", min_p=i / 100) for i in range(100)],
    }[name]
    cases = [c for c in grid if unambiguous(c, 1e-4)]
    assert len(cases) > 0.9 * len(grid)
    per_case = 2000
    tokens = draw([c for c in cases for _ in range(per_case)], seed=102).view(len(cases), per_case)
    for case, drawn in zip(cases, tokens):
        seen = torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, drawn, True)
        assert torch.equal(seen, reference(case) > 0), f"{case.name}: drew {seen.tolist()}"


def test_each_row_of_a_mixed_batch_follows_its_own_settings() -> None:
    """Rows of different settings (and greedy rows) interleaved in one batch: per-row tensors line up."""
    assert all(map(unambiguous, MIXED))
    tokens = draw(MIXED * (ROWS // len(MIXED)), seed=100)
    for i, case in enumerate(MIXED):
        mine = tokens[i :: len(MIXED)]
        if case.temperature == 0:
            assert torch.equal(mine, torch.full_like(mine, int(LOGITS.argmax())))
        else:
            assert_follows(mine, case)


def test_seeded_rows_follow_the_exact_distribution() -> None:
    """Rows with their own generators (the path of requests with a seed) draw from the same law."""
    case, rows = BY_NAME["all four"], 50_000
    generators = {row: torch.Generator().manual_seed(row) for row in range(rows)}
    assert_follows(draw([case] * rows, seed=101, generators=generators), case)


# ---- seeded requests across batch compositions ----


def run_seeded(target: Case, seed: int, others: list[tuple[Case, int | None]], position: int) -> list[int]:
    """30 steps of one seeded row among `others` (settings, seed or None), the target's logits the
    same at every composition, the others' logits fresh; returns the target's tokens."""
    vocab, steps = 32, 30
    target_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(0)) * 2
    other_logits = torch.Generator().manual_seed(1 + 100 * len(others) + position)
    rows = [*others[:position], (target, seed), *others[position:]]
    generators = {row: torch.Generator().manual_seed(s) for row, (_, s) in enumerate(rows) if s is not None}
    meta = metadata([settings for settings, _ in rows], vocab, generators)
    tokens = []
    with torch.random.fork_rng():
        for step in range(steps):
            logits = torch.randn(len(rows), vocab, generator=other_logits) * 2
            logits[position] = target_logits[step]
            tokens.append(int(sample(logits, meta)[position]))
    return tokens


def test_a_seeded_request_draws_the_same_tokens_in_any_batch() -> None:
    """Alone, or at another row next to unseeded, greedy and other seeded rows whose settings switch
    on the top-k, top-p and min-p tensors (neutral for the seeded row): the same tokens every time.
    End to end through `LLM`: test_same_seed_same_sample_alone_and_in_a_batch in tests/engine."""
    target = Case("target", temperature=0.9, top_p=0.95)
    compositions: list[tuple[list[tuple[Case, int | None]], int]] = [
        ([(Case("k", top_k=5), None), (Case("t", temperature=1.3), None), (GREEDY, None)], 2),
        ([(Case("m", temperature=0.6, min_p=0.1), 7), (GREEDY, None), (Case("k", top_k=2), 8)] * 5, 15),
        ([(BY_NAME["all four"], None), (target, 1234), (target, 99)], 0),
    ]
    alone = run_seeded(target, 1234, [], 0)
    assert len(set(alone)) > 3, "the target's tokens should vary"
    for others, position in compositions:
        assert run_seeded(target, 1234, others, position) == alone, f"row {position} of {len(others) + 1}"
    assert run_seeded(target, 4321, [], 0) != alone
