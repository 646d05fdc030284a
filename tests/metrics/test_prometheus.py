"""The Prometheus stat logger: every counter is exposed (at 0) from the first scrape, and the core's
cumulative counts (preemptions, prefix-cache queries and hits) become counters that take increases."""

from __future__ import annotations

from llmserve.engine.messages import SchedulerStats
from llmserve.metrics.prometheus import PrometheusStatLogger
from llmserve.metrics.stats import IterationStats

COUNTERS = (
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
)


def values(metrics: PrometheusStatLogger) -> dict[str, float | None]:
    """Each counter's value, None where /metrics would not show it."""
    return {
        name: metrics.registry.get_sample_value(f"llmserve:{name}_total", {"model_name": "m"})
        for name in COUNTERS
    }


def test_counters_start_at_zero_and_take_the_cores_increases() -> None:
    metrics = PrometheusStatLogger("m")
    assert values(metrics) == dict.fromkeys(COUNTERS, 0.0)
    assert 'llmserve:num_preemptions_total{model_name="m"} 0.0' in metrics.render().decode()

    snapshots = [
        SchedulerStats(num_preemptions=2, prefix_cache_queries=100, prefix_cache_hits=0),
        SchedulerStats(num_preemptions=5, prefix_cache_queries=300, prefix_cache_hits=96),
        SchedulerStats(num_preemptions=2, prefix_cache_queries=100, prefix_cache_hits=0),  # arrived late
        None,  # an output batch without stats
    ]
    for stats in snapshots:
        metrics.record(stats, IterationStats(num_prompt_tokens=7, num_generation_tokens=1))
    assert values(metrics) == {
        "num_preemptions": 5.0,
        "prompt_tokens": 28.0,
        "generation_tokens": 4.0,
        "prefix_cache_queries": 300.0,
        "prefix_cache_hits": 96.0,
    }
