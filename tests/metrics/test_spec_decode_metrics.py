"""Speculative decoding's stats, as vLLM reports them: the core's cumulative totals per data-parallel
rank become `vllm:spec_decode_*` counters (and their `llmserve:` twins) that take each rank's
increases, per guess position for the accepted tokens; the periodic log adds vLLM's SpecDecoding line
with the interval's counts summed over ranks. Without a speculative config neither shows anything."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from llmserve.contracts import SchedulerStats, SpecDecodingStats
from llmserve.metrics import loggers
from llmserve.metrics.loggers import LoggingStatLogger
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.metrics.stats import IterationStats

K = 3
TOTALS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
# Each rank's core counts from 0; rank 0 reports twice, rank 1 once.
RANK0_FIRST = SpecDecodingStats(4, 12, 6, [3, 2, 1])
RANK0_SECOND = SpecDecodingStats(10, 30, 12, [6, 4, 2])
RANK1_FIRST = SpecDecodingStats(2, 6, 3, [2, 1, 0])


def stats(spec: SpecDecodingStats | None) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=1, spec_decoding=spec)


def spec_values(metrics: PrometheusStatLogger, prefix: str, engine: str) -> list[float | None]:
    """The rank's three totals, then its accepted tokens per position, under one name prefix."""

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(
            f"{prefix}:spec_decode_{name}_total", {"model_name": "m", "engine": engine, **labels}
        )

    return [
        *(value(name) for name in TOTALS),
        *(value("num_accepted_tokens_per_pos", position=str(p)) for p in range(K)),
    ]


def test_prometheus_counters_take_each_ranks_increases_per_position() -> None:
    metrics = PrometheusStatLogger("m", num_engines=2)
    metrics.record(stats(RANK0_FIRST), IterationStats(), engine_index=0)
    # The first speculative stats create every rank's series, at 0 where nothing was counted yet.
    assert spec_values(metrics, "vllm", "1") == [0.0] * 6
    metrics.record(stats(RANK1_FIRST), IterationStats(), engine_index=1)
    metrics.record(stats(RANK0_SECOND), IterationStats(), engine_index=0)
    metrics.record(stats(RANK0_FIRST), IterationStats(), engine_index=0)  # arrived late: adds nothing
    metrics.record(None, IterationStats(num_generation_tokens=1), engine_index=1)
    for prefix in ("vllm", "llmserve"):
        assert spec_values(metrics, prefix, "0") == [10.0, 30.0, 12.0, 6.0, 4.0, 2.0]
        assert spec_values(metrics, prefix, "1") == [2.0, 6.0, 3.0, 2.0, 1.0, 0.0]
    text = metrics.render().decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 2.0' in text
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0'
        in text
    )
    assert 'position="3"' not in text  # positions 0..K-1 only


def test_log_line_sums_the_intervals_increases_over_ranks(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(loggers, "time", SimpleNamespace(monotonic=lambda: clock.now))
    caplog.set_level(logging.INFO, logger="llmserve")
    stat_logger = LoggingStatLogger(interval=4.0)

    def interval(seconds: float, *reports: tuple[SpecDecodingStats, int]) -> list[str]:
        """The lines logged after `reports` and `seconds`."""
        caplog.clear()
        for spec, rank in reports:
            stat_logger.record(stats(spec), IterationStats(num_generation_tokens=5), rank)
        clock.now += seconds
        stat_logger.maybe_log()
        return [r.getMessage() for r in caplog.records if r.name == "llmserve"]

    first = interval(5.0, (RANK0_FIRST, 0), (RANK1_FIRST, 1))
    assert len(first) == 2 and first[0].startswith("Avg prompt throughput")
    # 6 drafts of 18 tokens, 9 accepted (5, 3, 1 by position) in 5 s, over both ranks.
    assert first[1] == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 1.80 tokens/s, "
        "Drafted throughput: 3.60 tokens/s, Accepted: 9 tokens, Drafted: 18 tokens, "
        "Per-position acceptance rate: 0.833, 0.500, 0.167, Avg Draft acceptance rate: 50.0%"
    )
    # Only rank 0 drafted since: 6 drafts of 18 tokens, 6 accepted (3, 2, 1) in 4 s; rank 1's
    # unchanged totals add nothing.
    assert interval(4.0, (RANK0_SECOND, 0)) == [
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 1.2 tokens/s, "
        "Running: 2 reqs, Waiting: 0 reqs, KV cache usage: 0.0%",
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: 1.50 tokens/s, "
        "Drafted throughput: 4.50 tokens/s, Accepted: 6 tokens, Drafted: 18 tokens, "
        "Per-position acceptance rate: 0.500, 0.333, 0.167, Avg Draft acceptance rate: 33.3%",
    ]
    # Tokens but no new drafts: the periodic line alone.
    quiet = interval(5.0, (RANK0_SECOND, 0))
    assert len(quiet) == 1 and quiet[0].startswith("Avg prompt throughput")


def test_without_spec_decoding_nothing_spec_related_appears(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmserve")
    metrics, stat_logger = PrometheusStatLogger("m", num_engines=2), LoggingStatLogger(interval=0.0)
    for rank in (0, 1):
        for logger_ in (metrics, stat_logger):
            logger_.record(stats(None), IterationStats(num_generation_tokens=3), rank)
    stat_logger.maybe_log()
    assert "spec_decode" not in metrics.render().decode()
    messages = [r.getMessage() for r in caplog.records if r.name == "llmserve"]
    assert len(messages) == 1 and "SpecDecoding" not in messages[0]
