"""Full speed from the first request: when start-up ends, the blocks the first requests receive are
resident, and the warm-up has left a step of the configured shape nothing to fault in.

Each case runs in a fresh interpreter, as an engine core process runs: its heap keeps what steps free
(`keep_freed_heap`, then the warm-up), and nothing else in it has touched the pages first. The populate
thread is left out there, so that only start-up's own work is seen: the pages and faults are the
engine's, not the thread's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import ctypes, json, mmap, resource, sys, time
from llmserve.config import EngineArgs
from llmserve.engine.core import EngineCore
from llmserve.engine.heap_reuse import keep_freed_heap
from llmserve.contracts import EngineCoreRequest
from llmserve.model_executor import model_runner
from llmserve.sampling_params import SamplingParams

model_runner.populate_in_background = lambda *args: None  # start-up's own pages only
SEQS = 64
config = EngineArgs.from_kwargs(
    model=sys.argv[1], kv_cache_memory=256 << 20, max_num_seqs=SEQS, num_threads=1
).create_engine_config()
core = EngineCore(config)
keep_freed_heap()
if sys.argv[2] == "warm-up":
    core.warm_up(heap_kept=True)

libc = ctypes.CDLL(None)
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

def resident(block_id):
    # every head's slice of the block, in every layer's keys and values
    for pair in core.model_runner.kv_caches:
        for t in pair:
            for head in range(t.shape[0]):
                view = t[head, block_id]
                start = view.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
                end = view.data_ptr() + view.numel() * view.element_size()
                pages = -(-(end - start) // mmap.PAGESIZE)
                vec = (ctypes.c_ubyte * pages)()
                assert libc.mincore(start, end - start, vec) == 0
                if not all(v & 1 for v in vec):
                    return False
    return True

# the warm-up's shape: SEQS sequences of one token each, all sampling
params = SamplingParams(temperature=0.0, max_tokens=1)
for i in range(SEQS):
    core.add_request(EngineCoreRequest(f"r{i}", [100 + i], params, None, time.time()))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
scheduler_output = core.scheduler.schedule()
blocks = [b for s in scheduler_output.scheduled for b in s.block_ids]
core.model_runner.execute_model(scheduler_output)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({
    "faults": faults,
    "resident_blocks": core.model_runner.resident_blocks,
    "num_blocks": core.limits.num_kv_blocks,
    "blocks": blocks,
    "all_resident": all(resident(b) for b in blocks),
    "beyond_resident": resident(core.model_runner.resident_blocks + 1),
    "logits_pages": SEQS * core.limits.vocab_size * 4 // mmap.PAGESIZE,
}))
"""


def first_step(model: Path, mode: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model), mode], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def warmed(default_model_path: Path) -> dict[str, object]:
    return first_step(default_model_path, "warm-up")


def test_the_first_requests_receive_blocks_already_resident(warmed: dict[str, object]) -> None:
    """The blocks a step at the token budget (2048) with every sequence (64) can take are resident at
    start-up; the pool hands out those first, and the block past them is not resident (so the check
    could fail)."""
    assert warmed["resident_blocks"] == 2048 // 16 + 64 < warmed["num_blocks"]  # type: ignore[operator]
    assert len(warmed["blocks"]) == 64  # type: ignore[arg-type]
    assert warmed["all_resident"] and not warmed["beyond_resident"]


def test_the_warm_up_leaves_a_step_of_its_shape_nothing_to_fault_in(
    default_model_path: Path, warmed: dict[str, object]
) -> None:
    """Without the warm-up the same step faults in its temporaries (at least its logits' pages)."""
    cold = first_step(default_model_path, "none")
    logits_pages = int(warmed["logits_pages"])  # type: ignore[call-overload]
    assert int(cold["faults"]) >= logits_pages  # type: ignore[call-overload]
    assert int(warmed["faults"]) < logits_pages // 10  # type: ignore[call-overload]
