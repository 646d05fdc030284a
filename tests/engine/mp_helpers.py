"""Shared by the engine core process tests: a small config, greedy requests, and process checks."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from llmserve.config import EngineArgs, EngineConfig
from llmserve.contracts import EngineCoreRequest
from llmserve.sampling_params import SamplingParams

SMALL_KV = 16 << 20  # bytes of KV cache: plenty for the tiny model, quick to allocate


def tiny_config(model: Path, **options: object) -> EngineConfig:
    args: dict[str, object] = {"model": str(model), "kv_cache_memory": SMALL_KV, **options}
    return EngineArgs.from_kwargs(**args).create_engine_config()


def greedy_request(request_id: str, max_tokens: int, prompt_len: int = 8) -> EngineCoreRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = [3 + (7 * i + len(request_id)) % 250 for i in range(prompt_len)]
    return EngineCoreRequest(request_id, prompt, params, eos_token_id=2, arrival_time=time.time())


def process_gone(pid: int) -> bool:
    """No such process, or only a zombie left for init to reap."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not process_gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_after(pid: int, delay: float) -> list[float]:
    """SIGKILL `pid` after `delay` seconds, from a thread; the list gets the kill's monotonic time."""
    killed_at: list[float] = []

    def kill() -> None:
        time.sleep(delay)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    return killed_at
