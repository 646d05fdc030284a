"""Facts about the machine a benchmark runs on, and a warning when it is not quiet."""

from __future__ import annotations

import datetime
import os
import platform
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


def warn_if_busy(threshold: float = 0.3) -> float:
    """A 2-thread run collapses 3-10x when another process holds a core (OpenMP spin barriers).
    Returns the load, so that results files can record how quiet the machine was."""
    load = foreign_cpu_load()
    if load > threshold:
        print(f"WARNING: {load:.1f} cores are busy with other work; figures will be low.", file=sys.stderr)
    return load


def cpu_model() -> str:
    """The CPU's name, the vector extensions that decide CPU matmul speed, and our kernels' build."""
    from llmserve.model_executor.kernels import native

    name = platform.processor() or "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
                break
    flags = native.cpu_flags()
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8")
    extensions = [x for x in wanted if x in flags]
    return f"{name} ({', '.join(extensions) or 'no AVX2'}; kernels: {native.selected_isa()} build)"


def describe(foreign_load: float) -> dict[str, object]:
    """What a results file says about where its figures came from."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "foreign_load_cores": round(foreign_load, 2),
        "date": datetime.date.today().isoformat(),
    }
