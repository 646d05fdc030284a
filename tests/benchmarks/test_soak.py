"""The soak benchmark's request mix covers every shape it promises, reproducibly; and its verdict
fails a server whose memory grows more than the tolerance after the warm-up requests."""

from __future__ import annotations

import random
import sys

import pytest

from benchmarks.soak import WARMUP_REQUESTS, Sample, draw_shape, failures, memory_growth, parse_args


def test_the_mix_holds_every_shape_and_is_seeded() -> None:
    rng = random.Random(1)
    shapes = [draw_shape(rng, "m") for _ in range(2000)]
    paths = {s.path for s in shapes}
    assert paths == {"/completions", "/chat/completions"}
    assert any(s.body["stream"] for s in shapes) and not all(s.body["stream"] for s in shapes)
    assert any(s.body.get("n") == 2 for s in shapes)
    assert any("logprobs" in s.body for s in shapes)
    invalid = [s for s in shapes if s.expect_status == 400]
    assert invalid and all(s.body["max_tokens"] == -1 for s in invalid)
    dropped = [s for s in shapes if s.drop_after_first_chunk]
    assert dropped and all(s.body["stream"] and s.expect_status == 200 for s in dropped)
    rng_a, rng_b = random.Random(5), random.Random(5)
    assert [draw_shape(rng_a, "m") for _ in range(50)] == [draw_shape(rng_b, "m") for _ in range(50)]


def test_memory_growth_is_measured_from_the_end_of_the_warm_up() -> None:
    mib = 1 << 20
    warming = Sample(WARMUP_REQUESTS // 2, 50 * mib)  # the pool still faulting in: not the baseline
    samples = [warming, Sample(WARMUP_REQUESTS, 100 * mib), Sample(1000, 130 * mib), Sample(2000, 105 * mib)]
    assert memory_growth(samples) == pytest.approx(0.05)  # the last sample against the first after 100


def test_growth_beyond_ten_percent_fails_and_within_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["soak"])
    tolerance = parse_args().tolerance
    assert tolerance == 0.10
    idle = {"num_requests_running": 0.0, "num_requests_waiting": 0.0}
    assert failures(0.099, tolerance, [], idle) == failures(tolerance, tolerance, [], idle) == []
    assert failures(-0.05, tolerance, [], idle) == []
    assert failures(0.101, tolerance, [], idle) == ["resident memory grew +10.1%, more than 10%"]
    assert failures(0.0, tolerance, ["HTTP 500"], idle) == ["unexpected answers: 1"]
    left = {"num_requests_running": 1.0, "num_requests_waiting": 0.0}
    assert len(failures(0.0, tolerance, [], left)) == 1
