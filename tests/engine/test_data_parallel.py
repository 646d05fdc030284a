"""Data parallelism (`data_parallel_size=2`): two engine-core processes behind one front end. Requests
spread over both and give DP=1's greedy outputs; a pinned request runs on its rank; an abort reaches the
rank that owns the request; a rank that dies fails its own requests only, and the other serves on."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve import LLM, AsyncLLM, SamplingParams
from llmserve.contracts import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from llmserve.engine.core_launcher import PROCESS_TITLE
from llmserve.engine.dp_client import DPLBAsyncMPClient, DPSyncMPClient, LoadBalancer
from llmserve.engine.exceptions import EngineDeadError
from llmserve.engine.messages import HEARTBEAT_INTERVAL_S
from llmserve.model_executor import device
from llmserve.model_executor.cpu_threads import rank_placement
from llmserve.sampling_params import SamplingParams as Params

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4,",
    "The three primary colors are",
    "Water boils at",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
ENGINE: dict[str, Any] = {"num_threads": 1, "kv_cache_memory": 48 << 20, "max_model_len": 1024}


def prompt_tokens_seen(client: DPSyncMPClient, rank: int) -> int:
    """Prompt tokens the rank has looked up in its prefix cache: it has computed prompts if > 0."""
    return client.get_scheduler_stats(rank).prefix_cache_queries


@pytest.fixture(scope="module")
def single_outputs(default_model_path: object) -> list[list[int]]:
    with LLM(**ENGINE) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_offline_ranks_share_the_prompts_and_match_one_core(single_outputs: list[list[int]]) -> None:
    with LLM(data_parallel_size=2, **ENGINE) as llm:
        client = llm.llm_engine.engine_core
        assert isinstance(client, DPSyncMPClient)
        titles = {Path(f"/proc/{r.proc.pid}/cmdline").read_bytes().split(b"\0")[0] for r in client.ranks}
        assert titles == {f"{PROCESS_TITLE}_DP0".encode(), f"{PROCESS_TITLE}_DP1".encode()}
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert all(prompt_tokens_seen(client, rank) > 0 for rank in range(2))
        assert client.balancer.owner == {} and client.balancer.unfinished == [0, 0]
    assert outputs == single_outputs[: len(outputs)]  # the same kernels, one thread each: bit for bit


def test_the_balancer_picks_the_least_loaded_live_rank() -> None:
    balancer = LoadBalancer(3)

    def request(request_id: str, rank: int | None = None) -> EngineCoreRequest:
        return EngineCoreRequest(request_id, [1], Params(), None, 0.0, data_parallel_rank=rank)

    assert [balancer.assign(request(f"r{i}")) for i in range(4)] == [0, 1, 2, 0]
    balancer.kv_cache_usage = [0.0, 0.5, 0.1]
    balancer.observe(1, EngineCoreOutputs([EngineCoreOutput("r1", [5], FinishReason.STOP)]))
    balancer.observe(2, EngineCoreOutputs([EngineCoreOutput("r2", [5], FinishReason.STOP)]))
    assert balancer.unfinished == [2, 0, 0]
    assert balancer.assign(request("r4")) == 2  # ranks 1 and 2 are idle: the lower KV usage wins
    assert balancer.assign(request("r5", rank=0)) == 0  # pinned, however loaded
    assert balancer.by_rank(["r0", "r4", "unknown"]) == {0: ["r0"], 2: ["r4"]}
    assert sorted(balancer.fail_rank(0, "gone")) == ["r3", "r5"]
    assert balancer.unfinished == [0, 0, 0]
    assert balancer.assign(request("r6")) == 2  # never the dead rank 0
    with pytest.raises(EngineDeadError, match="rank 0 is dead: gone"):
        balancer.assign(request("r7", rank=0))
    # an id aborted on rank 1 and reused on rank 2: rank 1's late last output does not end the new one
    balancer.by_rank(["r6"])
    assert balancer.assign(request("r6", rank=1)) == 1
    balancer.by_rank(["r6"])
    assert balancer.assign(request("r6", rank=2)) == 2
    balancer.observe(1, EngineCoreOutputs([EngineCoreOutput("r6", [], FinishReason.ABORT)]))
    assert balancer.owner["r6"] == 2


def test_each_rank_gets_its_own_cores_when_they_fit() -> None:
    cores = sorted(os.sched_getaffinity(0))
    threads, cpus = rank_placement(2, 1)
    assert threads == 1
    assert cpus == ([[cores[0]], [cores[1]]] if len(cores) >= 2 else None)
    assert rank_placement(2, len(cores))[1] is None  # they would share cores: not pinned


def test_ranks_share_the_default_host_kv_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "_available_host_memory", lambda: 8 << 30)
    cpu = torch.device("cpu")
    assert device.kv_cache_budget(cpu, None) == 2 << 30
    assert device.kv_cache_budget(cpu, None, ranks=2) == 1 << 30
    assert device.kv_cache_budget(cpu, 48 << 20, ranks=2) == 48 << 20  # as requested, per rank


@pytest.fixture(scope="module")
async def engine(default_model_path: object) -> AsyncIterator[AsyncLLM]:
    llm = AsyncLLM(data_parallel_size=2, log_stats=False, **ENGINE)
    yield llm
    llm.shutdown()


def async_client(engine: AsyncLLM) -> DPLBAsyncMPClient:
    client = engine.engine_core
    assert isinstance(client, DPLBAsyncMPClient)
    return client


async def final_tokens(engine: AsyncLLM, prompt: str, request_id: str, **kwargs: object) -> list[int]:
    async for output in engine.generate(prompt, GREEDY, request_id, **kwargs):  # type: ignore[arg-type]
        tokens = list(output.outputs[0].token_ids)
    return tokens


async def queries(engine: AsyncLLM) -> list[int]:
    client = async_client(engine)
    return [(await client.get_scheduler_stats_async(r)).prefix_cache_queries for r in range(2)]


async def test_async_requests_spread_and_match_one_core(
    engine: AsyncLLM, single_outputs: list[list[int]]
) -> None:
    before = await queries(engine)
    outputs = await asyncio.gather(*(final_tokens(engine, p, f"spread-{i}") for i, p in enumerate(PROMPTS)))
    after = await queries(engine)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    assert outputs == single_outputs[: len(outputs)]  # the same kernels, one thread each: bit for bit


async def test_a_pinned_request_runs_on_its_rank(engine: AsyncLLM) -> None:
    before = await queries(engine)
    await final_tokens(engine, PROMPTS[0], "pinned", data_parallel_rank=1)
    after = await queries(engine)
    assert after[0] == before[0] and after[1] > before[1]
    out_of_range = r"data_parallel_rank must be between 0 and 1 \(data_parallel_size 2\), got 2"
    with pytest.raises(ValueError, match=out_of_range):
        await final_tokens(engine, PROMPTS[0], "pinned-out-of-range", data_parallel_rank=2)


async def test_an_abort_reaches_the_rank_that_owns_the_request(engine: AsyncLLM) -> None:
    client = async_client(engine)
    long = SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True)
    stream = engine.generate(PROMPTS[1], long, "to-abort", data_parallel_rank=1)
    await anext(stream)
    assert client.balancer.owner == {"to-abort": 1}
    assert (await client.get_scheduler_stats_async(1)).num_requests == 1
    await stream.aclose()  # aborts
    assert client.balancer.owner == {}
    for _ in range(100):  # the abort crosses to the core process
        if (await client.get_scheduler_stats_async(1)).num_requests == 0:
            break
        await asyncio.sleep(0.05)
    stats = await client.get_scheduler_stats_async(1)
    assert stats.num_requests == 0 and stats.num_free_blocks == stats.num_total_blocks


async def test_a_stopped_rank_is_unresponsive_until_it_resumes(engine: AsyncLLM) -> None:
    client = async_client(engine)
    timeout = 4 * HEARTBEAT_INTERVAL_S
    stopped = client.ranks[1].proc.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout + 5
        while not (silent := client.unresponsive_ranks(timeout)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert list(silent) == [1] and silent[1].startswith("Data-parallel rank 1: ")
    finally:
        os.kill(stopped, signal.SIGCONT)
    deadline = time.monotonic() + 5
    while client.unresponsive_ranks(timeout) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert client.unresponsive_ranks(timeout) == {}
    assert await final_tokens(engine, PROMPTS[0], "after-stop", data_parallel_rank=1)


async def test_a_dead_rank_fails_its_requests_and_the_other_serves_on(
    engine: AsyncLLM, single_outputs: list[list[int]]
) -> None:
    """Runs last in this module: it kills rank 1."""
    client = async_client(engine)
    long = SamplingParams(max_tokens=800, temperature=0.0, ignore_eos=True)
    doomed = engine.generate(PROMPTS[1], long, "doomed", data_parallel_rank=1)
    await anext(doomed)
    os.kill(client.ranks[1].proc.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="Data-parallel rank 1 died"):
        async for _ in doomed:
            pass
    assert list(client.dead_ranks) == [1]
    assert client.unresponsive_ranks(4 * HEARTBEAT_INTERVAL_S) == {}  # dead, which is another matter
    assert not engine.errored
    # the live rank takes every new request; a request pinned to the dead one fails at once
    after = [final_tokens(engine, p, f"after-{i}") for i, p in enumerate(PROMPTS[:3])]
    outputs = await asyncio.gather(*after)
    assert outputs == single_outputs[: len(outputs)]  # the same kernels, one thread each: bit for bit
    with pytest.raises(EngineDeadError, match="rank 1 is dead"):
        await final_tokens(engine, PROMPTS[0], "pinned-to-dead", data_parallel_rank=1)
    assert client.balancer.owner == {}


def test_a_single_core_is_rank_0(default_model_path: object) -> None:
    with LLM(**ENGINE) as llm:
        llm.llm_engine.engine_core.check_data_parallel_rank(0)
        with pytest.raises(ValueError, match=r"between 0 and 0 \(data_parallel_size 1\), got 1"):
            llm.llm_engine.engine_core.check_data_parallel_rank(1)
