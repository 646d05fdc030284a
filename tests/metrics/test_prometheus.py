"""The Prometheus stat logger: every series is exposed (at 0) from the first scrape, per data-parallel
rank (`engine` label); the core's cumulative counts (preemptions, prefix-cache queries and hits) become
counters that take each rank's increases; the gauges have a server-wide `engine="all"` series; and the
names that routers read are exported under vLLM's names with the same values, per rank only."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.contracts import SchedulerStats
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.metrics.stats import FinishedRequestStats, IterationStats

COUNTERS = (
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
)
# What routers (llm-d's endpoint picker, vllm-router) and vLLM dashboards read, by vLLM v1's names.
VLLM_NAMES = {
    "vllm:num_requests_running": "llmserve:num_requests_running",
    "vllm:num_requests_waiting": "llmserve:num_requests_waiting",
    "vllm:kv_cache_usage_perc": "llmserve:kv_cache_usage_perc",
    "vllm:num_preemptions_total": "llmserve:num_preemptions_total",
    "vllm:prompt_tokens_total": "llmserve:prompt_tokens_total",
    "vllm:generation_tokens_total": "llmserve:generation_tokens_total",
    "vllm:request_success_total": "llmserve:request_success_total",
    "vllm:time_to_first_token_seconds_bucket": "llmserve:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count": "llmserve:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum": "llmserve:time_to_first_token_seconds_sum",
    "vllm:e2e_request_latency_seconds_bucket": "llmserve:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count": "llmserve:e2e_request_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum": "llmserve:e2e_request_latency_seconds_sum",
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(metrics: PrometheusStatLogger) -> Samples:
    """Every sample of the rendered text (as a scraper parses it), by name and labels."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }


def value(metrics: PrometheusStatLogger, name: str, engine: str = "0", **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", "engine": engine, **labels})


def counters(metrics: PrometheusStatLogger, engine: str = "0") -> dict[str, float | None]:
    """Each counter's value for one rank, None where /metrics would not show it."""
    return {name: value(metrics, f"llmserve:{name}_total", engine) for name in COUNTERS}


def test_counters_start_at_zero_and_take_the_cores_increases() -> None:
    metrics = PrometheusStatLogger("m")
    assert counters(metrics) == dict.fromkeys(COUNTERS, 0.0)
    text = metrics.render().decode()
    assert 'llmserve:num_preemptions_total{engine="0",model_name="m"} 0.0' in text
    assert 'vllm:num_preemptions_total{engine="0",model_name="m"} 0.0' in text

    snapshots = [
        SchedulerStats(num_preemptions=2, prefix_cache_queries=100, prefix_cache_hits=0),
        SchedulerStats(num_preemptions=5, prefix_cache_queries=300, prefix_cache_hits=96),
        SchedulerStats(num_preemptions=2, prefix_cache_queries=100, prefix_cache_hits=0),  # arrived late
        None,  # an output batch without stats
    ]
    for stats in snapshots:
        metrics.record(stats, IterationStats(num_prompt_tokens=7, num_generation_tokens=1))  # positional
    assert counters(metrics) == {
        "num_preemptions": 5.0,
        "prompt_tokens": 28.0,
        "generation_tokens": 4.0,
        "prefix_cache_queries": 300.0,
        "prefix_cache_hits": 96.0,
    }


def test_each_rank_has_its_own_series_and_core_totals() -> None:
    """Rank 1's core counts from 0 like rank 0's: its smaller total is its own increase, not a late
    snapshot of rank 0's; tokens and finished requests land on the rank that reported them."""
    metrics = PrometheusStatLogger("m", num_engines=2)
    assert counters(metrics, "1") == dict.fromkeys(COUNTERS, 0.0)
    finished = [FinishedRequestStats("length", 2.0, 5, 3)]
    metrics.record(SchedulerStats(num_preemptions=5, prefix_cache_queries=64), IterationStats(9, 2), 0)
    metrics.record(SchedulerStats(num_preemptions=2, prefix_cache_queries=32), IterationStats(4, 1), 1)
    metrics.record(
        SchedulerStats(num_preemptions=3, prefix_cache_queries=48, prefix_cache_hits=16),
        IterationStats(num_generation_tokens=3, time_to_first_tokens=[0.5], finished_requests=finished),
        engine_index=1,
    )
    assert counters(metrics, "0") == {
        "num_preemptions": 5.0,
        "prompt_tokens": 9.0,
        "generation_tokens": 2.0,
        "prefix_cache_queries": 64.0,
        "prefix_cache_hits": 0.0,
    }
    assert counters(metrics, "1") == {
        "num_preemptions": 3.0,
        "prompt_tokens": 4.0,
        "generation_tokens": 4.0,
        "prefix_cache_queries": 48.0,
        "prefix_cache_hits": 16.0,
    }
    success = "llmserve:request_success_total"
    assert value(metrics, success, "1", finished_reason="length") == 1.0
    assert value(metrics, success, "0", finished_reason="length") == 0.0
    assert value(metrics, "llmserve:time_to_first_token_seconds_count", "1") == 1.0
    assert value(metrics, "llmserve:e2e_request_latency_seconds_sum", "1") == 2.0
    assert value(metrics, "llmserve:e2e_request_latency_seconds_count", "0") == 0.0
    assert value(metrics, "llmserve:prompt_tokens_total", "all") is None  # counters: per rank only
    with pytest.raises(ValueError, match="engine_index 2"):
        metrics.record(None, IterationStats(), engine_index=2)


def test_gauges_have_a_server_wide_series() -> None:
    """engine="all": running and waiting summed over ranks, KV usage their mean (a rank that has not
    reported yet counts as idle); updated whenever one rank's value changes."""
    metrics = PrometheusStatLogger("m", num_engines=4)

    def gauges(engine: str) -> tuple[float | None, ...]:
        names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        return tuple(value(metrics, f"llmserve:{name}", engine) for name in names)

    assert gauges("all") == (0.0, 0.0, 0.0)
    metrics.record(
        SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5), IterationStats(), 0
    )
    metrics.record(
        SchedulerStats(num_running_reqs=2, num_waiting_reqs=7, kv_cache_usage=1.0), IterationStats(), 3
    )
    assert gauges("0") == (3.0, 1.0, 0.5)
    assert gauges("3") == (2.0, 7.0, 1.0)
    assert gauges("1") == (0.0, 0.0, 0.0)
    assert gauges("all") == (5.0, 8.0, 0.375)
    metrics.record(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25), IterationStats(), 0)
    assert gauges("all") == (3.0, 7.0, 0.3125)
    metrics.record(None, IterationStats(), 3)  # no stats: the gauges stay
    assert gauges("all") == (3.0, 7.0, 0.3125)


def test_one_rank_has_no_server_wide_series() -> None:
    """It would repeat rank 0's values and double a sum() over the gauge."""
    metrics = PrometheusStatLogger("m")
    metrics.record(SchedulerStats(num_running_reqs=3), IterationStats())
    assert value(metrics, "llmserve:num_requests_running", "0") == 3.0
    assert value(metrics, "llmserve:num_requests_running", "all") is None


def test_vllm_names_carry_the_same_values_per_rank() -> None:
    """Every sample of a vLLM-named metric equals ours, with the same labels; ours has the one more
    series engine="all" for the gauges; nothing LoRA-related, as vLLM without LoRA."""
    metrics = PrometheusStatLogger("m", num_engines=2)
    for engine in (0, 1):
        metrics.record(
            SchedulerStats(num_running_reqs=2 + engine, num_waiting_reqs=engine, kv_cache_usage=0.1 * engine,
                           num_preemptions=4 + engine),
            IterationStats(
                num_prompt_tokens=11 * (engine + 1),
                num_generation_tokens=3,
                time_to_first_tokens=[0.03, 0.7 * (engine + 1)],
                finished_requests=[FinishedRequestStats("stop", 0.4 + engine, 11, 3)],
            ),
            engine,
        )  # fmt: skip
    found = samples(metrics)
    vllm = {key: v for key, v in found.items() if key[0].startswith("vllm:")}
    assert {name for name, _ in vllm} == set(VLLM_NAMES)
    assert not any(name.startswith("vllm:lora") for name, _ in found)
    for (name, labels), v in vllm.items():
        assert dict(labels)["engine"] in ("0", "1") and dict(labels)["model_name"] == "m"
        assert found[(VLLM_NAMES[name], labels)] == v, (name, labels)
    ours = {
        (n, labels) for n, labels in found if n in VLLM_NAMES.values() and ("engine", "all") not in labels
    }
    assert ours == {(VLLM_NAMES[n], labels) for n, labels in vllm}
    # The values a router reads, spelled as vLLM spells them.
    assert found[("vllm:num_requests_running", frozenset({("model_name", "m"), ("engine", "1")}))] == 3.0
    assert found[("vllm:kv_cache_usage_perc", frozenset({("model_name", "m"), ("engine", "1")}))] == 0.1
    assert found[("vllm:prompt_tokens_total", frozenset({("model_name", "m"), ("engine", "1")}))] == 22.0
    assert value(metrics, "vllm:num_preemptions_total", "1") == 5.0
    assert value(metrics, "vllm:request_success_total", "0", finished_reason="stop") == 1.0
    assert value(metrics, "vllm:time_to_first_token_seconds_bucket", "1", le="2560.0") == 2.0
