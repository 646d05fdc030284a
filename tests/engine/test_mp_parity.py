"""The real default model: `LLM` over the engine core process gives the greedy outputs of the in-process
core, and its shutdown leaves nothing behind."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import cast

from llmserve import LLM, SamplingParams
from llmserve.engine.mp_client import SyncMPClient, _CoreProcess
from tests.engine.mp_helpers import wait_until_gone
from tests.greedy_match import assert_same_greedy

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "1, 2, 3, 5, 8, 13,",
]
# logprobs only to tell a near-tie (batches may be cut differently across the two cores) from a bug
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)


def test_process_core_matches_in_process_core(default_model_path: Path) -> None:
    llm = LLM(kv_cache_memory=64 << 20)
    client = llm.llm_engine.engine_core
    assert isinstance(client, SyncMPClient)
    # a local core process (client.proc says so), not a Ray actor
    pid, ipc_dir = client.proc.pid, cast(_CoreProcess, client._core).ipc_dir
    assert pid is not None
    try:
        process_outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        start = time.monotonic()
        llm.shutdown()
    assert time.monotonic() - start < 5
    assert client.proc.returncode == 0 and wait_until_gone(pid, timeout=1) and not os.path.exists(ipc_dir)
    llm.shutdown()  # again: a no-op

    with LLM(kv_cache_memory=64 << 20, multiprocess=False) as inproc:
        inproc_outputs = inproc.generate(PROMPTS, GREEDY, use_tqdm=False)
        pairs = list(zip(process_outputs, inproc_outputs, strict=True))
        ties = [assert_same_greedy(inproc, ours, theirs) for ours, theirs in pairs]
    for tie, (ours, theirs) in zip(ties, pairs):
        assert tie is not None or ours.outputs[0].text == theirs.outputs[0].text
