"""`SyncMPClient` and `LLM` over the engine core process: handshake, start-up failures, death, orphans."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.engine.core import EngineCore
from llmserve.engine.core_client import EngineCoreClient, InprocClient
from llmserve.engine.core_launcher import PROCESS_TITLE
from llmserve.engine.exceptions import EngineDeadError
from llmserve.engine.front_end import make_client
from llmserve.engine.mp_client import SyncMPClient
from tests.engine.mp_helpers import greedy_request, kill_after, tiny_config, wait_until_gone


@pytest.fixture(scope="module")
def client(tiny_llama_hf_dir: Path) -> Iterator[SyncMPClient]:
    engine = SyncMPClient(tiny_config(tiny_llama_hf_dir))
    yield engine
    engine.shutdown()


def run_to_completion(client: EngineCoreClient, max_tokens: dict[str, int]) -> dict[str, list[int]]:
    """Add one greedy request per id and gather its tokens (ignoring leftovers of earlier tests)."""
    for request_id, n in max_tokens.items():
        client.add_request(greedy_request(request_id, n))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in max_tokens}
    unfinished = set(max_tokens)
    while unfinished:
        for output in client.get_output().outputs:
            if output.request_id in tokens:
                tokens[output.request_id].extend(output.new_token_ids)
                if output.finished:
                    unfinished.discard(output.request_id)
    return tokens


def test_handshake_reports_what_the_core_resolved(client: SyncMPClient, tiny_llama_hf_dir: Path) -> None:
    assert client.limits == EngineCore(tiny_config(tiny_llama_hf_dir)).limits
    with open(f"/proc/{client.proc.pid}/cmdline", "rb") as f:
        assert f.read().startswith(PROCESS_TITLE.encode())


def test_same_tokens_as_in_process_and_nothing_left_behind(
    client: SyncMPClient, tiny_llama_hf_dir: Path
) -> None:
    budgets = {f"same-{i}": 5 + 3 * i for i in range(4)}
    inproc = InprocClient(tiny_config(tiny_llama_hf_dir))
    assert run_to_completion(client, budgets) == run_to_completion(inproc, budgets)
    stats = client.get_scheduler_stats()
    assert stats.num_requests == 0
    assert stats.num_free_blocks == stats.num_total_blocks == client.limits.num_kv_blocks


def test_abort_frees_kv_blocks_at_once(client: SyncMPClient) -> None:
    # The core runs ahead of this process: on a busy machine the tiny model can finish all its tokens
    # before the stats are asked for, so a try that finds the requests gone is made again with new ids.
    for attempt in range(5):
        ids = [f"abort-{attempt}-0", f"abort-{attempt}-1"]
        for request_id in ids:
            client.add_request(greedy_request(request_id, 980, prompt_len=40))
        started: set[str] = set()
        while started != set(ids):
            started.update(o.request_id for o in client.get_output().outputs)
        held = client.get_scheduler_stats()
        if held.num_requests == 2:
            break
        client.abort_requests(ids)  # one may still run
    assert held.num_requests == 2 and held.num_free_blocks < held.num_total_blocks
    client.abort_requests(ids)
    stats = client.get_scheduler_stats()  # answered after the abort: messages arrive in order
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_total_blocks


def test_bad_model_path_raises_value_error_with_the_cores_message(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match="not found"):
        SyncMPClient(tiny_config(tmp_path / "missing"))
    assert time.monotonic() - start < 30  # the child's imports; never a hang


def test_core_that_cannot_start_reports_its_error(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_llama_hf_dir / "config.json", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match="failed to start: SafetensorError"):
        SyncMPClient(tiny_config(tmp_path))


def test_core_killed_while_starting(tiny_llama_hf_dir: Path) -> None:
    before = {p.pid for p in psutil.Process().children()}

    def kill_the_new_child() -> None:
        while True:
            new = [p for p in psutil.Process().children() if p.pid not in before]
            if new:
                os.kill(new[0].pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    threading.Thread(target=kill_the_new_child, daemon=True).start()
    with pytest.raises(EngineDeadError, match="while starting .*SIGKILL"):
        SyncMPClient(tiny_config(tiny_llama_hf_dir))


def test_async_engine_refuses_an_in_process_core() -> None:
    with pytest.raises(ValueError, match="multiprocess=False"):
        make_client(EngineConfig(multiprocess=False), asyncio_mode=True)


def test_sigkill_during_generate_raises_engine_dead_error(tiny_llama_hf_dir: Path) -> None:
    llm = LLM(model=str(tiny_llama_hf_dir), kv_cache_memory=16 << 20)
    client = llm.llm_engine.engine_core
    assert isinstance(client, SyncMPClient) and client.proc.pid is not None
    # Seconds of work, well past the kill (8 such prompts took 0.46 s on a Zen 5 core pair: too few).
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    killed_at = kill_after(client.proc.pid, 0.5)
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        llm.generate(["Hello there"] * 64, params, use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < 5
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="SIGKILL"):
        llm.generate("Hello again", params, use_tqdm=False)
    assert time.monotonic() - start < 1
    llm.shutdown()


# Exits without shutdown(), normally or killed: either way neither the core nor its IPC folder may outlive it.
ORPHAN_SCRIPT = """
import os, signal, sys
from llmserve import LLM
llm = LLM(model=sys.argv[1], kv_cache_memory=16 << 20)
client = llm.llm_engine.engine_core
print("CORE", client.proc.pid, client._core.ipc_dir, flush=True)
if sys.argv[2] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("parent_end", ["exits", "killed"])
def test_core_does_not_outlive_its_parent(tiny_llama_hf_dir: Path, parent_end: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", ORPHAN_SCRIPT, str(tiny_llama_hf_dir), parent_end],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("CORE ")]
    assert lines, result.stderr
    pid, ipc_dir = int(lines[0][1]), lines[0][2]
    assert wait_until_gone(pid, timeout=5), f"engine core {pid} outlived its parent: {result.stderr}"
    assert not os.path.exists(ipc_dir)
    assert result.returncode == (0 if parent_end == "exits" else -signal.SIGKILL), result.stderr


# As a vLLM user writes it: no `if __name__ == "__main__":` guard. A core started by multiprocessing's spawn
# would import this script again (and fail in its bootstrapping phase); the core must never run it.
NO_GUARD_SCRIPT = """
import sys
print("script ran", flush=True)
from llmserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], kv_cache_memory=16 << 20)
print("text", repr(llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].text))
llm.shutdown()
"""


@pytest.mark.parametrize("how", ["file", "-c", "stdin"])
def test_a_script_without_a_main_guard(tiny_llama_hf_dir: Path, tmp_path: Path, how: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(NO_GUARD_SCRIPT)
    source = {"file": [str(script)], "-c": ["-c", NO_GUARD_SCRIPT], "stdin": ["-"]}[how]
    result = subprocess.run(
        [sys.executable, *source, str(tiny_llama_hf_dir)],
        input=NO_GUARD_SCRIPT if how == "stdin" else None,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("script ran") == 1, result.stdout  # the core never ran it
    assert re.search(r"^text '.+'$", result.stdout, re.MULTILINE), result.stdout
