"""Engine stats as Prometheus metrics, for the server's `/metrics`. Names follow vLLM's, prefixed
`llmserve:`, so existing dashboards need only the prefix changed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmserve.engine.messages import SchedulerStats
from llmserve.metrics.stats import IterationStats

# Bucket bounds in seconds: from a fast GPU's first token up to a long CPU generation.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0)  # fmt: skip
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


class PrometheusStatLogger:
    """A stat logger for `AsyncLLM(stat_loggers=[...])`. Its metrics live in its own registry, not the
    process-wide default one, so several engines in one process (tests) never collide."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]
        self.running = Gauge(
            "llmserve:num_requests_running", "Requests in the running batch.", labels, registry=r
        )
        self.waiting = Gauge("llmserve:num_requests_waiting", "Requests waiting to run.", labels, registry=r)
        self.kv_cache_usage = Gauge(
            "llmserve:kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (1 = full).",
            labels,
            registry=r,
        )
        self.preemptions = Counter(
            "llmserve:num_preemptions", "Requests preempted for lack of KV blocks.", labels, registry=r
        )
        self.prompt_tokens = Counter("llmserve:prompt_tokens", "Prompt tokens prefilled.", labels, registry=r)
        self.generation_tokens = Counter(
            "llmserve:generation_tokens", "Tokens generated.", labels, registry=r
        )
        self.prefix_cache_queries = Counter(
            "llmserve:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "llmserve:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            labels,
            registry=r,
        )
        self.request_success = Counter(
            "llmserve:request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "llmserve:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "llmserve:inter_token_latency_seconds",
            "Time between two output tokens of a request.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "llmserve:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        # `SchedulerStats`' fields that the core counts since it started: each counter takes the increase.
        self._from_core = {
            "num_preemptions": self.preemptions,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
        }
        self._core_seen = dict.fromkeys(self._from_core, 0)
        # Present (at 0) from the start, so rates work from the first scrape.
        for counter in (*self._from_core.values(), self.prompt_tokens, self.generation_tokens):
            counter.labels(model_name)
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        name = self.model_name
        if scheduler_stats is not None:
            self.running.labels(name).set(scheduler_stats.num_running_reqs)
            self.waiting.labels(name).set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage.labels(name).set(scheduler_stats.kv_cache_usage)
            for field, counter in self._from_core.items():
                total = getattr(scheduler_stats, field)
                if total > self._core_seen[field]:
                    counter.labels(name).inc(total - self._core_seen[field])
                    self._core_seen[field] = total
        self.prompt_tokens.labels(name).inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(iteration_stats.num_generation_tokens)
        ttft, itl, e2e = self.ttft.labels(name), self.itl.labels(name), self.e2e.labels(name)
        for seconds in iteration_stats.time_to_first_tokens:
            ttft.observe(seconds)
        for seconds in iteration_stats.inter_token_latencies:
            itl.observe(seconds)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(name, finished.finish_reason).inc()
            e2e.observe(finished.e2e_latency)

    def maybe_log(self) -> None:
        """Nothing to push: Prometheus scrapes `render()`."""

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
