"""The engine core's heap keeps what a step frees for the next step, instead of handing it back.

A prefill step allocates megabytes of temporaries ([tokens, width] activations) and frees them. glibc maps
some afresh (mmap) and trims the heap's free top back to the kernel once it passes twice its mmap
threshold (64 MiB at most), so the next step faults the same memory in again, page by page
(docs/performance/kernel-measurements.md has what it cost). After start-up (whose temporaries are gone by
then), every block comes from the heap, and up to 1 GiB of freed heap stays resident, reused at once.
Raising the mmap threshold to its most (32 MiB) is not enough: a wider model's prefill holds larger
temporaries (Qwen2.5-0.5B's MLP over a 2,048-token chunk: 80 MiB a layer), which glibc would map afresh in
every layer of every step. Resident memory then stays at the largest step's, flat under load
(`benchmarks/soak.py`). `reserve_heap` makes the heap a step will need resident ahead of it without
running the step (the engine core's warm-up).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def keep_freed_heap() -> bool:
    """Sets glibc's thresholds for this process; False where the C library is not glibc or refuses."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = bool(mallopt(_M_MMAP_MAX, 0))  # no block mapped on its own: every one from the heap
    kept = kept and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if kept:
        logger.info(
            "Heap: every block from the heap; up to %d MiB of it kept once freed.",
            TRIM_THRESHOLD >> 20,
        )
    return kept


def heap_size() -> int | None:
    """Bytes the heap has taken from the kernel (glibc's `arena`): with freed heap kept, the high-water
    mark of what steps have used. None where the C library does not say."""
    mallinfo2 = getattr(_libc(), "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info: _MallInfo2 = mallinfo2()
    return int(info.arena)


def reserve_heap(extra: int) -> None:
    """Grows the heap `extra` bytes past its high-water mark, every page of it resident and free for
    the next allocations (with `keep_freed_heap()` in force, else it would be handed back at once)."""
    libc = _libc()
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    # a block as large as the free top and `extra` together comes from the top, extended by `extra`
    size = min(int(libc.mallinfo2().keepcost) + extra, TRIM_THRESHOLD)
    block = libc.malloc(size)
    if block is None:
        raise MemoryError(f"could not reserve {size} bytes of heap")
    ctypes.memset(block, 0, size)
    libc.free(block)
