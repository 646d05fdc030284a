"""Periodic stats log lines: throughput, queue lengths and KV cache usage while the engine is busy, and
vLLM's speculative decoding line when guesses were checked."""

from __future__ import annotations

import logging
import time
from itertools import zip_longest

from llmserve.contracts import SchedulerStats, SpecDecodingStats
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
        self._spec_logged: dict[int, SpecDecodingStats] = {}  # each rank's totals at the last line

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
        self._log_spec_decoding(elapsed)
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = 0

    def _log_spec_decoding(self, elapsed: float) -> None:
        """vLLM's SpecDecoding line for the interval: each rank's totals less those at the last line,
        summed over ranks. Mean acceptance length counts the step's own token, as vLLM's does."""
        interval = SpecDecodingStats()
        for rank, stats in self._scheduler_stats.items():
            if (now := stats.spec_decoding) is None:
                continue
            before = self._spec_logged.get(rank, SpecDecodingStats())
            interval.num_drafts += now.num_drafts - before.num_drafts
            interval.num_draft_tokens += now.num_draft_tokens - before.num_draft_tokens
            interval.num_accepted_tokens += now.num_accepted_tokens - before.num_accepted_tokens
            per_pos = zip_longest(
                interval.num_accepted_tokens_per_pos,
                now.num_accepted_tokens_per_pos,
                before.num_accepted_tokens_per_pos,
                fillvalue=0,
            )
            interval.num_accepted_tokens_per_pos = [total + n - b for total, n, b in per_pos]
            self._spec_logged[rank] = now
        drafts = interval.num_drafts
        if drafts <= 0:
            return
        drafted, accepted = interval.num_draft_tokens, interval.num_accepted_tokens
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
            1 + accepted / drafts,
            accepted / elapsed,
            drafted / elapsed,
            accepted,
            drafted,
            ", ".join(f"{n / drafts:.3f}" for n in interval.num_accepted_tokens_per_pos),
            accepted / drafted * 100 if drafted else float("nan"),
        )
