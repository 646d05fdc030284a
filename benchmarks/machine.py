"""Facts about the machine a benchmark runs on, and a warning when it is not quiet."""

from __future__ import annotations

import os
import sys
import time


def _busy_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def foreign_cpu_load(seconds: float = 1.0) -> float:
    """Cores' worth of CPU busy over a short window before the benchmark starts."""
    busy0, total0 = _busy_jiffies()
    time.sleep(seconds)
    busy1, total1 = _busy_jiffies()
    return (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)


def warn_if_busy(threshold: float = 0.3) -> None:
    """A 2-thread run collapses 3-10x when another process holds a core (OpenMP spin barriers)."""
    load = foreign_cpu_load()
    if load > threshold:
        print(f"WARNING: {load:.1f} cores are busy with other work; figures will be low.", file=sys.stderr)
