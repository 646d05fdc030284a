"""Host memory for the KV cache the CPU kernels read: made resident at start-up, in the order the block
pool hands blocks out.

Left to fault in as requests first write it, the pool would grow the process for thousands of
requests, until every block had served once: resident memory would climb under load, and a pool the
machine cannot hold would fail mid-serving instead of at start-up. So the whole pool is faulted in when
it is allocated, as vLLM's is, and the memory the start-up log announces is the memory the process
holds. First touch is slow on some VMs (the host backs each fresh page as the guest clears it: seconds
per GiB), so start-up waits only for the blocks the first steps take (`populate` of a range); a thread
in the idle scheduling class faults in the rest, 256 KiB at a time, a run of blocks after another, and
tells the block pool how far it got, which hands out resident blocks first (`BlockPool`). Pages the
engine writes before the thread reaches them fault in as they are written, as they would with no
thread. In plain 4 KiB pages: on such a VM transparent huge pages took several times as long to fault
in, and 64 sequences decoded slower from them.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
import time
from collections.abc import Callable

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


def populate(
    tensors: list[torch.Tensor], blocks: range, on_resident: Callable[[int], None] | None = None
) -> bool:
    """Faults in the pages of `blocks` of the CPU tensors, keeping their contents, a run of blocks at a
    time, in order.

    Each tensor is laid out [outer, blocks, ...] (the KV pool's head-major layout), all with the same
    number of blocks. Blocks [blocks.start, b) of every tensor are resident before `on_resident(b)` is
    called: in the order the block pool hands them out, so the first requests write to pages that are
    there. Returns False where the kernel cannot (before Linux 5.14): pages then come as they are first
    written. Stops early once the main thread has ended, since the process is exiting."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    block_bytes = [t[0, 0].numel() * t.element_size() for t in tensors]
    step = max(1, _CHUNK // max(block_bytes))
    for first in range(blocks.start, blocks.stop, step):
        last = min(first + step, blocks.stop)
        for t, nbytes in zip(tensors, block_bytes):
            for row in range(t.shape[0]):
                start = t.data_ptr() + row * t.stride(0) * t.element_size() + first * nbytes
                end = start + (last - first) * nbytes
                start = start // page * page  # a block may start mid-page; a small tensor comes from malloc
                # A foreign call releases the GIL: the engine goes on while the kernel faults pages in.
                # A chunk at a time, since the kernel holds the process's memory map meanwhile, which the
                # engine's own mappings (every large tensor it allocates) wait for.
                if not threading.main_thread().is_alive():
                    return True
                if libc.madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
                    return False
        if on_resident is not None:
            on_resident(last)
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


def populate_in_background(
    tensors: list[torch.Tensor], blocks: range, on_resident: Callable[[int], None] | None = None
) -> threading.Thread:
    """`populate` on a thread that runs almost only when a core is idle; logs how long it took.

    Not a daemon: one that drops the last reference to the pool while the interpreter finalizes aborts
    the process (torch's buffer deleter is unwound by the thread's forced exit: "terminate called
    without an active exception"). The interpreter waits for it instead, a chunk at most, since
    `populate` stops once the main thread has ended."""

    def run() -> None:
        run_only_when_idle()
        start = time.perf_counter()
        nbytes = sum(t.numel() * t.element_size() for t in tensors) * len(blocks) // tensors[0].shape[1]
        if not populate(tensors, blocks, on_resident):
            logger.info("KV cache pages come as they are first written (no MADV_POPULATE_WRITE here).")
            if on_resident is not None:  # as good as resident: no block is better to hand out than another
                on_resident(blocks.stop)
        elif threading.main_thread().is_alive():  # else cut short: the process is exiting
            logger.info("KV cache resident: %.2f GiB in %.1f s.", nbytes / 2**30, time.perf_counter() - start)

    thread = threading.Thread(target=run, name="kv-cache-populate", daemon=False)
    thread.start()
    return thread
