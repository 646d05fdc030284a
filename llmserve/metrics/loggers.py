"""Periodic stats log lines: throughput, queue lengths and KV cache usage while the engine is busy."""

from __future__ import annotations

import logging
import time

from llmserve.engine.messages import SchedulerStats
from llmserve.metrics.stats import IterationStats

logger = logging.getLogger("llmserve")


class LoggingStatLogger:
    """Accumulates token counts between log lines; logs every `interval` seconds, and only when
    something happened since the last line."""

    def __init__(self, interval: float = 5.0) -> None:
        self.interval = interval
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._scheduler_stats: dict[int, SchedulerStats] = {}  # the latest of each data-parallel rank

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats, engine_index: int = 0
    ) -> None:
        if scheduler_stats is not None:
            self._scheduler_stats[engine_index] = scheduler_stats
        self._prompt_tokens += iteration_stats.num_prompt_tokens
        self._generation_tokens += iteration_stats.num_generation_tokens

    def maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval:
            return
        ranks = self._scheduler_stats.values()
        running = sum(s.num_running_reqs for s in ranks)
        waiting = sum(s.num_waiting_reqs for s in ranks)
        kv_cache_usage = sum(s.kv_cache_usage for s in ranks) / max(len(ranks), 1)  # the ranks' mean
        if self._prompt_tokens or self._generation_tokens or running or waiting:
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                self._prompt_tokens / elapsed,
                self._generation_tokens / elapsed,
                running,
                waiting,
                kv_cache_usage * 100,
            )
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = 0
