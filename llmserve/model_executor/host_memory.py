"""Host memory for the KV cache the CPU kernels read: made resident in the background at start-up.

Left to fault in as requests first write it, the pool would grow the process for thousands of
requests, until every block had served once (prefix caching hands out the least recently used block,
so all of them come round): resident memory would climb under load, and a pool the machine cannot
hold would fail mid-serving instead of at start-up. So the whole pool is faulted in when it is
allocated, as vLLM's is, and the memory the start-up log announces is the memory the process holds.
On a thread of its own, which start-up does not wait for: first touch cost 0.35-1.75 s per GiB on a
Zen 4 VM, and 6-7 s per GiB on another whose host backs each fresh page as the guest clears it (24-29
s for the default 4 GiB pool, in the kernel's clear_page). The thread is in the idle scheduling class
and faults in 256 KiB at a time. On that VM's 2 cores, with nice 19 and 2 MiB at a time, 64 SmolLM2
requests sent right after start-up ran at 111-126 output tok/s; now at 150-162 (160 with no
populating at all); each change alone gave part of that (nice 19 with 256 KiB: 131, 154; the idle
class with 2 MiB: 140, 149). Pages the engine writes before the thread reaches them fault in as they
are written, as they would with no thread.

In plain 4 KiB pages: on that VM, faulting in transparent huge pages took 6x as long, and 64 sequences
decoded 8% slower from them (they had measured ~8% faster attention, one part of a step, on a Zen 3
machine).
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time

import torch

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux 5.14; not among Python 3.11's mmap constants
# What an engine mapping may wait for (populate): ~1.6 ms of faulting on the slow VM once the thread
# has a core, longer while the engine's threads keep it from one.
_CHUNK = 256 << 10


def empty_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in a page-aligned mapping of its own, which it keeps alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def populate(tensors: list[torch.Tensor]) -> bool:
    """Faults in every page of the CPU tensors, keeping their contents. Returns False where the kernel
    cannot (before Linux 5.14): their pages then come as they are first written. Stops early once the
    main thread has ended, since the process is exiting."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for t in tensors:
        start = t.data_ptr() // page * page  # a small tensor's memory comes from malloc, not page-aligned
        end = t.data_ptr() + t.numel() * t.element_size()
        # A foreign call releases the GIL: the engine goes on while the kernel faults pages in. A chunk
        # at a time, since the kernel holds the process's memory map meanwhile, which the engine's own
        # mappings (every large tensor it allocates) wait for.
        for chunk in range(start, end, _CHUNK):
            if not threading.main_thread().is_alive():
                return True
            if libc.madvise(chunk, min(_CHUNK, end - chunk), _MADV_POPULATE_WRITE) != 0:
                return False
    return True


def run_only_when_idle() -> None:
    """Puts the calling thread in the idle scheduling class, where it gets a core almost only when no
    thread of normal priority wants it; at nice 19 where the system refuses that (a seccomp profile, a
    kernel without the class)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError) as e:
        logger.info("The KV cache's populate thread runs at nice 19 (no idle scheduling class: %s).", e)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def populate_in_background(tensors: list[torch.Tensor]) -> threading.Thread:
    """`populate` on a thread that runs almost only when a core is idle; logs how long it took.

    Not a daemon: one that drops the last reference to the pool while the interpreter finalizes aborts
    the process (torch's buffer deleter is unwound by the thread's forced exit: "terminate called
    without an active exception"). The interpreter waits for it instead, a chunk at most, since
    `populate` stops once the main thread has ended."""

    def run() -> None:
        run_only_when_idle()
        start = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if not populate(tensors):
            logger.info("KV cache pages come as they are first written (no MADV_POPULATE_WRITE here).")
        elif threading.main_thread().is_alive():  # else cut short: the process is exiting
            logger.info("KV cache resident: %.2f GiB in %.1f s.", nbytes / 2**30, time.perf_counter() - start)

    thread = threading.Thread(target=run, name="kv-cache-populate", daemon=False)
    thread.start()
    return thread
