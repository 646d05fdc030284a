"""Engine stats as Prometheus metrics, for the server's `/metrics`. Names follow vLLM's, prefixed
`llmserve:`, so existing dashboards need only the prefix changed; the few that routers read (llm-d's
endpoint picker, vllm-router, the Gateway API inference extension) are exported under vLLM's own
`vllm:` names as well, with vLLM's meaning and labels, and so are speculative decoding's counters, which
vLLM's dashboards read.

Every series carries `model_name` and `engine`: the data-parallel rank ("0".."N-1"), as vLLM labels
them. With more than one rank our gauges also carry a server-wide series, `engine="all"`; vLLM's names
carry only the ranks, as vLLM's do."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from llmserve.contracts import SchedulerStats, SpecDecodingStats
from llmserve.metrics.stats import IterationStats

# Bucket bounds in seconds: every bound of vLLM's own histograms, so that a query written for vLLM's
# `le` values finds them; E2E adds 0.1 s, which a small model on a fast machine reaches.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0)  # fmt: skip
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")
ALL_ENGINES = "all"
LABELS = ("model_name", "engine")


class Kind(enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"  # prometheus_client appends `_total` to the name
    HISTOGRAM = "histogram"


class ServerWide(enum.Enum):
    """How a gauge's `engine="all"` series combines the ranks' values (the value is its help text)."""

    SUM = "the sum over ranks"
    MEAN = "the mean over ranks, each weighted equally"


@dataclass(frozen=True)
class MetricSpec:
    """One metric: `name` after `llmserve:`, and `vllm_name` (in full) where routers read it under
    vLLM's name too. `core_field` names the `SchedulerStats` field it reads: a gauge's value, or a
    counter's total since the core started (the counter takes each increase). A gauge with
    `server_wide` has an `engine="all"` series under our name."""

    name: str
    vllm_name: str | None
    help: str
    kind: Kind
    core_field: str | None = None
    server_wide: ServerWide | None = None
    buckets: tuple[float, ...] = ()
    extra_label: str | None = None

    @property
    def labelnames(self) -> list[str]:
        return [*LABELS, self.extra_label] if self.extra_label else list(LABELS)

    @property
    def our_help(self) -> str:
        return (
            self.help if self.server_wide is None else f'{self.help} engine="all": {self.server_wide.value}.'
        )


# vLLM also has `vllm:lora_requests_info`, which llm-d's endpoint picker reads for LoRA affinity;
# vLLM registers it only when LoRA is configured. We serve no LoRA adapters, so, like vLLM without
# LoRA, we emit nothing under that name.
METRICS = (
    MetricSpec("num_requests_running", "vllm:num_requests_running", "Requests in the running batch.",
               Kind.GAUGE, "num_running_reqs", ServerWide.SUM),
    MetricSpec("num_requests_waiting", "vllm:num_requests_waiting", "Requests waiting to be scheduled.",
               Kind.GAUGE, "num_waiting_reqs", ServerWide.SUM),
    MetricSpec("kv_cache_usage_perc", "vllm:kv_cache_usage_perc",
               "Fraction of KV cache blocks in use (1 = full).", Kind.GAUGE, "kv_cache_usage",
               ServerWide.MEAN),
    MetricSpec("num_preemptions", "vllm:num_preemptions", "Requests preempted for lack of KV blocks.",
               Kind.COUNTER, "num_preemptions"),
    MetricSpec("prompt_tokens", "vllm:prompt_tokens", "Prompt tokens prefilled.", Kind.COUNTER),
    MetricSpec("generation_tokens", "vllm:generation_tokens", "Tokens generated.", Kind.COUNTER),
    MetricSpec("prefix_cache_queries", None, "Prompt tokens looked up in the prefix cache.", Kind.COUNTER,
               "prefix_cache_queries"),
    MetricSpec("prefix_cache_hits", None, "Prompt tokens found in the prefix cache.", Kind.COUNTER,
               "prefix_cache_hits"),
    MetricSpec("request_success", "vllm:request_success", "Finished requests, by finish reason.",
               Kind.COUNTER, extra_label="finished_reason"),
    MetricSpec("time_to_first_token_seconds", "vllm:time_to_first_token_seconds", "Time to first token.",
               Kind.HISTOGRAM, buckets=TTFT_BUCKETS),
    MetricSpec("inter_token_latency_seconds", None, "Time between two output tokens of a request.",
               Kind.HISTOGRAM, buckets=ITL_BUCKETS),
    MetricSpec("e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
               "Time from arrival to the last token.", Kind.HISTOGRAM, buckets=E2E_BUCKETS),
)  # fmt: skip
# Speculative decoding's counters, each the increases of a `SpecDecodingStats` total (`core_field`).
# vLLM registers them only with a speculative config; we learn of one from the first stats that carry
# `spec_decoding`, and create them then, every rank's series at 0, per guess position ("0".."K-1") for
# the last. Acceptance rate per position, in PromQL: `rate(vllm:spec_decode_num_accepted_tokens_per_pos_total
# [5m]) / ignoring(position) group_left rate(vllm:spec_decode_num_drafts_total[5m])`.
SPEC_DECODE_METRICS = (
    MetricSpec("spec_decode_num_drafts", "vllm:spec_decode_num_drafts",
               "Decode steps that checked guessed tokens.", Kind.COUNTER, "num_drafts"),
    MetricSpec("spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Guessed tokens checked.",
               Kind.COUNTER, "num_draft_tokens"),
    MetricSpec("spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
               "Guessed tokens accepted.", Kind.COUNTER, "num_accepted_tokens"),
    MetricSpec("spec_decode_num_accepted_tokens_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos",
               "Guessed tokens accepted, by position in the guess.", Kind.COUNTER,
               "num_accepted_tokens_per_pos", extra_label="position"),
)  # fmt: skip
GAUGE_SPECS = [spec for spec in METRICS if spec.kind is Kind.GAUGE]
CORE_COUNTER_SPECS = [spec for spec in METRICS if spec.kind is Kind.COUNTER and spec.core_field]

M = TypeVar("M", Gauge, Counter, Histogram)


class Twin(Generic[M]):
    """One metric under our name and, where routers read it, vLLM's: every update goes to both, so
    the two never disagree."""

    def __init__(self, ours: M, vllm: M | None) -> None:
        self.ours: M = ours
        self.vllm: M | None = vllm

    def labels(self, *values: str) -> list[M]:
        """The series of `values` in both metrics (created, at 0, the first time)."""
        return [m.labels(*values) for m in (self.ours, self.vllm) if m is not None]


def twins(
    kind: Kind, new: Callable[[MetricSpec, str, str], M], specs: tuple[MetricSpec, ...] = METRICS
) -> dict[str, Twin[M]]:
    """The table's metrics of `kind`, each made by `new(spec, name, help)` under our name and vLLM's."""
    return {
        spec.name: Twin(
            new(spec, f"llmserve:{spec.name}", spec.our_help),
            new(spec, spec.vllm_name, spec.help) if spec.vllm_name else None,
        )
        for spec in specs
        if spec.kind is kind
    }


class PrometheusStatLogger:
    """A stat logger for `AsyncLLM(stat_loggers=[...])`, shared by all `num_engines` data-parallel
    ranks: `record` takes the rank that sent the stats. Its metrics live in its own registry, not the
    process-wide default one, so several engines in one process (tests) never collide."""

    def __init__(
        self, model_name: str, registry: CollectorRegistry | None = None, num_engines: int = 1
    ) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be at least 1, got {num_engines}")
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.num_engines = num_engines
        self.gauges = twins(Kind.GAUGE, lambda s, name, doc: Gauge(name, doc, s.labelnames, registry=r))
        self.counters = twins(Kind.COUNTER, self._counter)
        self.histograms = twins(
            Kind.HISTOGRAM,
            lambda s, name, doc: Histogram(name, doc, s.labelnames, buckets=s.buckets, registry=r),
        )
        # Per rank: the gauges' last values (for the "all" series); per counter series (name, then
        # label values): the core's last total.
        self._gauge_values = {spec.name: [0.0] * num_engines for spec in GAUGE_SPECS}
        self._core_seen: dict[tuple[str, ...], int] = {}
        # Every series present (at 0) from the start, so that rates work from the first scrape.
        by_rank: list[Twin[Any]] = [*self.gauges.values(), *self.counters.values(), *self.histograms.values()]
        by_rank.remove(self.counters["request_success"])
        for rank in map(str, range(num_engines)):
            for twin in by_rank:
                twin.labels(model_name, rank)
            for reason in FINISH_REASONS:
                self.counters["request_success"].labels(model_name, rank, reason)
        # With one rank the "all" series would repeat it, and double any sum() over the gauge.
        self._server_wide = num_engines > 1
        for spec in GAUGE_SPECS:
            if spec.server_wide is not None and self._server_wide:
                self.gauges[spec.name].ours.labels(model_name, ALL_ENGINES)

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats, engine_index: int = 0
    ) -> None:
        if not 0 <= engine_index < self.num_engines:
            raise ValueError(f"engine_index {engine_index} is not a rank of {self.num_engines} engines")
        labels = (self.model_name, str(engine_index))
        counters, histograms = self.counters, self.histograms
        if scheduler_stats is not None:
            self._record_gauges(scheduler_stats, engine_index)
            for spec in CORE_COUNTER_SPECS:
                self._take_increase(spec.name, labels, getattr(scheduler_stats, str(spec.core_field)))
            if scheduler_stats.spec_decoding is not None:
                self._record_spec_decoding(scheduler_stats.spec_decoding, labels)
        for counter in counters["prompt_tokens"].labels(*labels):
            counter.inc(iteration_stats.num_prompt_tokens)
        for counter in counters["generation_tokens"].labels(*labels):
            counter.inc(iteration_stats.num_generation_tokens)
        observations = {
            "time_to_first_token_seconds": iteration_stats.time_to_first_tokens,
            "inter_token_latency_seconds": iteration_stats.inter_token_latencies,
            "e2e_request_latency_seconds": [f.e2e_latency for f in iteration_stats.finished_requests],
        }
        for name, seconds in observations.items():
            for histogram in histograms[name].labels(*labels):
                for value in seconds:
                    histogram.observe(value)
        for finished in iteration_stats.finished_requests:
            for counter in counters["request_success"].labels(*labels, finished.finish_reason):
                counter.inc()

    def _counter(self, spec: MetricSpec, name: str, doc: str) -> Counter:
        return Counter(name, doc, spec.labelnames, registry=self.registry)

    def _take_increase(self, name: str, labels: tuple[str, ...], total: int) -> None:
        """Adds to counter `name`'s series the core's `total` less the last one seen there; a smaller
        total (a snapshot that arrived late) adds nothing."""
        key = (name, *labels)
        seen = self._core_seen.get(key, 0)
        if total > seen:
            for counter in self.counters[name].labels(*labels):
                counter.inc(total - seen)
            self._core_seen[key] = total

    def _record_spec_decoding(self, stats: SpecDecodingStats, labels: tuple[str, str]) -> None:
        if SPEC_DECODE_METRICS[0].name not in self.counters:  # the first stats from a speculative core
            self.counters.update(twins(Kind.COUNTER, self._counter, SPEC_DECODE_METRICS))
            positions = [str(p) for p in range(len(stats.num_accepted_tokens_per_pos))]
            for rank in map(str, range(self.num_engines)):
                for spec in SPEC_DECODE_METRICS:
                    for extra in [(p,) for p in positions] if spec.extra_label else [()]:
                        self.counters[spec.name].labels(self.model_name, rank, *extra)
        for spec in SPEC_DECODE_METRICS:
            total = getattr(stats, str(spec.core_field))
            if spec.extra_label:  # a total per guess position
                for position, count in enumerate(total):
                    self._take_increase(spec.name, (*labels, str(position)), count)
            else:
                self._take_increase(spec.name, labels, total)

    def _record_gauges(self, stats: SchedulerStats, engine_index: int) -> None:
        """The rank's gauges, then the server-wide series that its value changes."""
        for spec in GAUGE_SPECS:
            values = self._gauge_values[spec.name]
            values[engine_index] = float(getattr(stats, str(spec.core_field)))
            for gauge in self.gauges[spec.name].labels(self.model_name, str(engine_index)):
                gauge.set(values[engine_index])
            if spec.server_wide is not None and self._server_wide:
                total = sum(values)
                server_wide = total / len(values) if spec.server_wide is ServerWide.MEAN else total
                self.gauges[spec.name].ours.labels(self.model_name, ALL_ENGINES).set(server_wide)

    def maybe_log(self) -> None:
        """Nothing to push: Prometheus scrapes `render()`."""

    def render(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
