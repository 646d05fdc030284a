"""How many threads compute, and where.

The engine core's OpenMP threads spin at barriers between operations; a second busy process on one of
their cores stalls every barrier (a 2-thread run slows 3-10x). So the core takes the cores this
process may run on; the server's front end, a process we own, loads no torch and so starts no compute
threads (it only tokenizes, detokenizes and moves messages). This module only counts and places the
threads, for both sides; the core applies the count (`device.configure_core_threads`).
"""

from __future__ import annotations

import os


def core_thread_count(requested: int | None) -> int:
    """As requested, else OMP_NUM_THREADS (the user's word), else every core in this process's affinity."""
    if requested is not None:
        return requested
    from_env = os.environ.get("OMP_NUM_THREADS", "")
    if from_env.isdigit() and int(from_env) > 0:
        return int(from_env)
    return len(os.sched_getaffinity(0))


def rank_placement(size: int, requested: int | None) -> tuple[int, list[list[int]] | None]:
    """Threads per data-parallel rank (as requested, else this process's cores divided among the `size`
    ranks), and each rank's own CPUs where the ranks fit on this process's cores without sharing one;
    None where they do not."""
    threads = requested if requested is not None else max(1, core_thread_count(None) // size)
    cores = sorted(os.sched_getaffinity(0))
    if threads * size > len(cores):
        return threads, None
    return threads, [cores[rank * threads : (rank + 1) * threads] for rank in range(size)]
