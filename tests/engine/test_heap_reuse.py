"""The engine core's heap keeps what a step frees: after keep_freed_heap(), a step's worth of tensors
(nine of 10-80 MiB, held together as a prefill holds its temporaries, 240 MiB; past 32 MiB, the most
glibc's mmap threshold can be, as a wide model's MLP over a long chunk) stays resident once freed, for
the next step to reuse without faulting it in; without it, glibc hands it back at once."""

from __future__ import annotations

import subprocess
import sys

STEP = """
import os, sys, torch
from llmserve.engine.heap_reuse import keep_freed_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap()
def resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
held = [torch.empty(mib << 18) for mib in [10, 20, 15, 40, 80, 15, 10, 20, 30]]
for t in held:
    t.fill_(1.0)
during = resident()
del held, t
print(during - resident())
"""


def resident_bytes_freed(mode: str) -> int:
    """How much resident memory freeing one step's tensors hands back, in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1])


def test_a_steps_freed_tensors_stay_resident_for_the_next() -> None:
    assert resident_bytes_freed("keep") < 8 << 20
    assert resident_bytes_freed("default") > 200 << 20  # what glibc hands back, to fault in again


RESERVE = """
import os, sys, torch
from llmserve.engine.heap_reuse import heap_size, keep_freed_heap, reserve_heap
def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
assert keep_freed_heap()
torch.empty(2 << 20).fill_(1.0)  # torch's threads and first allocations come before the measurement
before = heap_size()
if sys.argv[1] == "reserve":
    reserve_heap(100 << 20)
grown = heap_size() - before
resident = resident_bytes()
held = [torch.empty(mib << 18).fill_(1.0) for mib in [30, 50, 15]]
print(grown, resident_bytes() - resident)
"""


def reserved_then_filled(mode: str) -> tuple[int, int]:
    """The heap's growth from `reserve_heap`, and resident memory's from filling 95 MiB of tensors after."""
    result = subprocess.run([sys.executable, "-c", RESERVE, mode], capture_output=True, text=True, check=True)
    grown, resident = result.stdout.split()[-2:]
    return int(grown), int(resident)


def test_reserved_heap_is_resident_for_the_tensors_after_it() -> None:
    """What the warm-up does for the first full step: without the reservation the same tensors bring
    their pages in as they are filled."""
    grown, resident = reserved_then_filled("reserve")
    assert grown >= 100 << 20 and resident < 16 << 20
    assert reserved_then_filled("none")[1] > 60 << 20  # 95 MiB, less the 8 MiB freed before it
