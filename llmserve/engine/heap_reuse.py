"""The engine core's heap keeps what a step frees for the next step, instead of handing it back.

A prefill step allocates megabytes of temporaries ([tokens, width] activations) and frees them. glibc
maps some afresh (mmap) and trims the heap's free top back to the kernel once it passes twice its mmap
threshold (64 MiB at most), so the next step faults the same memory in again, page by page: 9% of a
SmolLM2 run of 64 prompts of 32-512 tokens (194 against 178 tok/s, alternating, with the equivalent
MALLOC_*_ variables). After start-up (whose temporaries are gone by then), every block comes from the
heap, and up to 1 GiB of freed heap stays resident, reused at once. Raising the mmap threshold to its
most (32 MiB) is not enough: a wider model's prefill holds larger temporaries (Qwen2.5-0.5B's MLP over
a 2,048-token chunk: 80 MiB a layer), which glibc would map afresh in every layer of every step (1.3
million faults in a batch of 32 prompts of 64-192 tokens). Resident memory then stays at the largest
step's, flat under load (`benchmarks/soak.py`).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
TRIM_THRESHOLD = 1 << 30


def keep_freed_heap() -> bool:
    """Sets glibc's thresholds for this process; False where the C library is not glibc or refuses."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
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
