"""The engine core's heap keeps what a step frees: after keep_freed_heap(), tensors of the sizes a prefill
step allocates (3-31 MiB) come back without faulting a page in; without it, the same cycles do."""

from __future__ import annotations

import subprocess
import sys

CYCLES = """
import resource, sys, torch
from llmserve.engine.heap_reuse import keep_freed_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap()
def cycle():
    for mib in [3, 20, 5, 30, 12, 25, 9, 31]:
        t = torch.empty(mib << 18)
        t.fill_(1.0)
        del t
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    """Minor page faults of three rounds of allocating, filling and freeing, in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1])


def test_freed_tensors_come_back_without_page_faults() -> None:
    assert page_faults("keep") < 100
    assert page_faults("default") > 1000  # the measurement sees what the setting removes
