"""`AsyncMPClient`: streaming outputs, aborts that free blocks at once, and death that wakes every waiter."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from llmserve.engine.exceptions import EngineDeadError
from llmserve.engine.messages import HEARTBEAT_INTERVAL_S
from llmserve.engine.mp_client import AsyncMPClient, _CoreProcess
from tests.engine.mp_helpers import greedy_request, tiny_config, wait_until_gone

# One loop for the module: the client binds the loop of its first call.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def client(tiny_llama_hf_dir: Path) -> Iterator[AsyncMPClient]:
    engine = AsyncMPClient(tiny_config(tiny_llama_hf_dir))
    yield engine
    engine.shutdown()


async def gather_tokens(client: AsyncMPClient, ids: set[str]) -> dict[str, list[int]]:
    """Outputs of `ids` until each has finished (other requests' outputs are skipped)."""
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    unfinished = set(ids)
    while unfinished:
        outputs = await asyncio.wait_for(client.get_output_async(), timeout=30)
        for output in outputs.outputs:
            if output.request_id in tokens:
                tokens[output.request_id].extend(output.new_token_ids)
                if output.finished:
                    unfinished.discard(output.request_id)
    return tokens


async def test_requests_stream_until_finished(client: AsyncMPClient) -> None:
    budgets = {f"stream-{i}": 4 + 5 * i for i in range(4)}
    for request_id, n in budgets.items():
        await client.add_request_async(greedy_request(request_id, n))
    tokens = await gather_tokens(client, set(budgets))
    assert {request_id: len(t) for request_id, t in tokens.items()} == budgets
    stats = await client.get_scheduler_stats_async()
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_total_blocks


async def test_abort_frees_kv_blocks_at_once(client: AsyncMPClient) -> None:
    ids = {f"abort-{i}" for i in range(3)}
    for request_id in ids:
        await client.add_request_async(greedy_request(request_id, 500, prompt_len=40))
    started: set[str] = set()
    while started != ids:
        started.update(o.request_id for o in (await client.get_output_async()).outputs)
    held = await client.get_scheduler_stats_async()
    assert held.num_requests == 3 and held.num_free_blocks < held.num_total_blocks
    await client.abort_requests_async(sorted(ids))
    stats = await client.get_scheduler_stats_async()  # answered after the abort: messages arrive in order
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_total_blocks


async def test_concurrent_utility_calls_each_get_their_answer(client: AsyncMPClient) -> None:
    results = await asyncio.gather(*(client.get_scheduler_stats_async() for _ in range(5)))
    assert all(r.num_total_blocks == client.limits.num_kv_blocks for r in results)


async def test_an_idle_core_is_heard_and_a_stopped_one_is_not_until_it_resumes(
    client: AsyncMPClient,
) -> None:
    timeout = 2 * HEARTBEAT_INTERVAL_S
    await asyncio.sleep(3 * HEARTBEAT_INTERVAL_S)  # idle: only its heartbeats speak for it
    assert client.unresponsive_ranks(timeout) == {}
    os.kill(client.proc.pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        while not (silent := client.unresponsive_ranks(timeout)) and time.monotonic() - stopped_at < 5:
            await asyncio.sleep(0.05)
        assert list(silent) == [0] and "stopped or hung" in silent[0]
        assert time.monotonic() - stopped_at > timeout - HEARTBEAT_INTERVAL_S  # not before its time
    finally:
        os.kill(client.proc.pid, signal.SIGCONT)
    resumed_at = time.monotonic()
    while client.unresponsive_ranks(timeout) and time.monotonic() - resumed_at < 5:
        await asyncio.sleep(0.05)
    assert client.unresponsive_ranks(timeout) == {}
    await client.add_request_async(greedy_request("after-stop", 4))
    assert len((await gather_tokens(client, {"after-stop"}))["after-stop"]) == 4


async def test_sigkill_wakes_every_waiter(tiny_llama_hf_dir: Path) -> None:
    client = AsyncMPClient(tiny_config(tiny_llama_hf_dir))
    # a local core process (client.proc says so), not a Ray actor
    pid, ipc_dir = client.proc.pid, cast(_CoreProcess, client._core).ipc_dir
    assert pid is not None
    waiters = [asyncio.create_task(client.get_output_async()) for _ in range(2)]
    await asyncio.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for waiter in waiters:
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await asyncio.wait_for(waiter, timeout=5)
    assert time.monotonic() - killed_at < 5
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        await client.add_request_async(greedy_request("late", 4))
    with pytest.raises(EngineDeadError):
        await client.get_output_async()
    with pytest.raises(EngineDeadError):
        await client.get_scheduler_stats_async()
    await client.abort_requests_async(["late"])  # nothing to abort in a dead core: no error
    assert time.monotonic() - start < 1
    client.shutdown()
    client.shutdown()
    assert wait_until_gone(pid, timeout=1) and not os.path.exists(ipc_dir)


async def test_busy_loop_error_reaches_every_waiter_with_its_cause(tiny_llama_hf_dir: Path) -> None:
    client = AsyncMPClient(tiny_config(tiny_llama_hf_dir))
    await client.add_request_async(greedy_request("twice", 500))
    await client.add_request_async(greedy_request("twice", 500))  # the core's scheduler refuses a duplicate
    with pytest.raises(EngineDeadError, match="ValueError: Request id 'twice' is already in use"):
        while True:
            await asyncio.wait_for(client.get_output_async(), timeout=10)
    assert client.proc.wait(5) == 1
    client.shutdown()
