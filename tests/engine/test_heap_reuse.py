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
