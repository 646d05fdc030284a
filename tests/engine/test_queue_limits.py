"""Overload control in AsyncLLM: queue limits (and their release on every path), the queue timeout, and
priorities, over a tiny model's engine core. `QueueLimits` alone first."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

from llmserve import LLM, AsyncLLM, SamplingParams
from llmserve.contracts import EngineCoreRequest
from llmserve.engine.exceptions import EngineDeadError
from llmserve.engine.input_processor import TokensPrompt
from llmserve.engine.queue_limits import QueueFullError, QueueLimits, QueueTimeoutError
from llmserve.outputs import RequestOutput
from tests.engine.test_async_llm import assert_core_is_empty, greedy

PROMPT = TokensPrompt(prompt_token_ids=list(range(3, 13)))  # 10 tokens


def core_request(request_id: str, num_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1] * num_tokens, SamplingParams(), None, 0.0)


def test_queue_limits_admit_all_or_nothing_and_release_once() -> None:
    limits = QueueLimits(max_num_queued_requests=3, max_num_queued_tokens=25)
    limits.admit([core_request("a", 30)])  # alone in the queue: admitted although over the token limit
    with pytest.raises(QueueFullError, match="max_num_queued_tokens"):
        limits.admit([core_request("b", 1)])
    limits.release(["a", "a", "unknown"])
    assert (limits.num_requests, limits.num_tokens) == (0, 0)
    limits.admit([core_request("a", 10), core_request("b", 10)])
    with pytest.raises(QueueFullError, match="max_num_queued_tokens"):
        limits.admit([core_request("c", 6)])
    with pytest.raises(QueueFullError, match="max_num_queued_requests"):
        limits.admit([core_request("c", 1), core_request("d", 1)])
    assert (limits.num_requests, limits.num_tokens) == (2, 20)  # the refused left nothing
    limits.admit([core_request("c", 5)])
    limits.release(["b"])
    assert (limits.num_requests, limits.num_tokens) == (2, 15)
    with pytest.raises(ValueError, match="max_num_queued_requests must be at least 1"):
        QueueLimits(0, None)


def make_engine(model: Path, **kwargs: Any) -> AsyncLLM:
    return AsyncLLM(model=str(model), kv_cache_memory=8 << 20, log_stats=False, max_num_seqs=1, **kwargs)


async def started(stream: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
    """Waits for the stream's first output: its request is running, no longer queued."""
    await anext(stream)
    return stream


async def drain(stream: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    outputs = [output async for output in stream]
    return outputs[-1]


async def test_queue_limits_refuse_and_every_path_releases(tiny_llama_hf_dir: Path) -> None:
    engine = make_engine(tiny_llama_hf_dir, max_num_queued_requests=2, max_num_queued_tokens=25)
    try:
        for _ in range(2):  # the second round proves the first released everything
            running = await started(engine.generate(PROMPT, greedy(900), "running"))
            finishing = asyncio.create_task(drain(engine.generate(PROMPT, greedy(2), "finishing")))
            aborted = engine.generate(PROMPT, greedy(2), "aborted")
            first = asyncio.create_task(anext(aborted))
            await asyncio.sleep(0.05)
            assert (engine.queue.num_requests, engine.queue.num_tokens) == (2, 20)
            with pytest.raises(QueueFullError, match="max_num_queued_requests"):
                await anext(engine.generate(PROMPT, greedy(2), "refused"))
            assert "refused" not in engine.output_processor.request_states
            first.cancel()  # a client that leaves before its first output
            await asyncio.gather(first, return_exceptions=True)
            await aborted.aclose()
            assert engine.queue.num_requests == 1
            with pytest.raises(QueueFullError, match="max_num_queued_tokens"):
                await anext(engine.generate(TokensPrompt(prompt_token_ids=[5] * 16), greedy(2), "too-long"))
            await running.aclose()
            assert (await finishing).finished
            assert (engine.queue.num_requests, engine.queue.num_tokens) == (0, 0)
            await assert_core_is_empty(engine)
    finally:
        engine.shutdown()


async def test_engine_death_releases_the_queue(tiny_llama_hf_dir: Path) -> None:
    engine = make_engine(tiny_llama_hf_dir, max_num_queued_requests=1)
    try:
        running = await started(engine.generate(PROMPT, greedy(900), "running"))
        queued = asyncio.create_task(drain(engine.generate(PROMPT, greedy(2), "queued")))
        await asyncio.sleep(0.05)
        assert engine.queue.num_requests == 1
        os.kill(engine.engine_core.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        with pytest.raises(EngineDeadError):
            await queued
        with pytest.raises(EngineDeadError):
            await drain(running)
        assert engine.queue.num_requests == engine.queue.num_tokens == 0
    finally:
        engine.shutdown()


async def test_queue_timeout_fails_the_request_and_frees_it(tiny_llama_hf_dir: Path) -> None:
    engine = make_engine(tiny_llama_hf_dir, max_queue_time=0.3, max_num_queued_requests=4)
    try:
        running = await started(engine.generate(PROMPT, greedy(900), "running"))
        params = SamplingParams(n=2, max_tokens=2, seed=1)  # a parent: both samples expire together
        late = asyncio.create_task(drain(engine.generate(PROMPT, params, "late")))
        # "running" may finish its 900 tokens within max_queue_time on a fast machine: the core is
        # paused, once "late" has reached its queue, for longer than that, so its deadline passes first
        core = engine.engine_core.proc.pid  # type: ignore[attr-defined]
        await asyncio.sleep(0.02)
        os.kill(core, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.5)
        finally:
            os.kill(core, signal.SIGCONT)
        with pytest.raises(QueueTimeoutError, match="max_queue_time"):
            await late
        assert not engine.output_processor.parents
        assert list(engine.output_processor.request_states) == ["running"]
        assert engine.queue.num_requests == 0
        await running.aclose()
        await assert_core_is_empty(engine)
        assert (await drain(engine.generate(PROMPT, greedy(2), "after"))).finished
    finally:
        engine.shutdown()


async def test_priority_orders_the_waiting_queue_end_to_end(tiny_llama_hf_dir: Path) -> None:
    engine = make_engine(tiny_llama_hf_dir, scheduling_policy="priority")
    try:
        running = await started(engine.generate(PROMPT, greedy(900), "running"))
        done: list[str] = []

        async def run(request_id: str, priority: int) -> None:
            await drain(engine.generate(PROMPT, greedy(2), request_id, priority=priority))
            done.append(request_id)

        tasks = []
        core = engine.engine_core.proc.pid  # type: ignore[attr-defined]
        os.kill(core, signal.SIGSTOP)  # "running" cannot finish before all three wait behind it
        try:
            for request_id, priority in (("low", 5), ("mid", 0), ("high", -5)):
                tasks.append(asyncio.create_task(run(request_id, priority)))
                await asyncio.sleep(0.02)  # in this order into the core
        finally:
            os.kill(core, signal.SIGCONT)
        await asyncio.sleep(0.1)
        await running.aclose()
        await asyncio.gather(*tasks)
        assert done == ["high", "mid", "low"]
    finally:
        engine.shutdown()


async def test_fcfs_refuses_a_priority(tiny_llama_hf_dir: Path) -> None:
    engine = make_engine(tiny_llama_hf_dir)
    try:
        with pytest.raises(ValueError, match="^priority 1 needs the priority scheduling policy"):
            await anext(engine.generate(PROMPT, greedy(2), "x", priority=1))
        assert (await drain(engine.generate(PROMPT, greedy(2), "y", priority=0))).finished
    finally:
        engine.shutdown()


def test_llm_generate_takes_one_priority_per_prompt(tiny_llama_hf_dir: Path) -> None:
    with LLM(str(tiny_llama_hf_dir), kv_cache_memory=8 << 20, scheduling_policy="priority") as llm:
        outputs = llm.generate([PROMPT, PROMPT], greedy(2), use_tqdm=False, priority=[3, -1])
        assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 2]
        with pytest.raises(ValueError, match="Got 1 priorities for 2 prompts"):
            llm.generate([PROMPT, PROMPT], greedy(2), use_tqdm=False, priority=[3])
    with (
        LLM(str(tiny_llama_hf_dir), kv_cache_memory=8 << 20) as llm,
        pytest.raises(ValueError, match="^priority"),
    ):
        llm.generate([PROMPT], greedy(2), use_tqdm=False, priority=[3])
