"""AsyncLLM over the engine core process: streaming, cancellation, n > 1, slow consumers, death."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from llmserve.engine.exceptions import EngineDeadError
from llmserve.outputs import RequestOutput
from tests.engine.test_llm_batching import random_prompts


def make_engine(model: Path) -> AsyncLLM:
    return AsyncLLM(model=str(model), kv_cache_memory=8 << 20, log_stats=False)


@pytest.fixture(scope="module")
async def engine(tiny_llama_hf_dir: Path) -> AsyncIterator[AsyncLLM]:
    llm = make_engine(tiny_llama_hf_dir)
    yield llm
    llm.shutdown()


async def collect(
    engine: AsyncLLM, prompt: object, params: SamplingParams, request_id: str
) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id)]  # type: ignore[arg-type]


async def drain(stream: AsyncIterator[RequestOutput]) -> None:
    async for _ in stream:
        pass


async def assert_core_is_empty(engine: AsyncLLM) -> None:
    stats = await engine.engine_core.get_scheduler_stats_async()  # type: ignore[attr-defined]
    for _ in range(50):  # aborts travel to the core asynchronously
        if stats.num_requests == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return
        await asyncio.sleep(0.05)
        stats = await engine.engine_core.get_scheduler_stats_async()  # type: ignore[attr-defined]
    raise AssertionError(f"the core still holds work: {stats}")


def greedy(max_tokens: int, kind: RequestOutputKind = RequestOutputKind.DELTA) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind)


async def test_delta_stream_concatenates_to_the_final_output(engine: AsyncLLM) -> None:
    prompt = random_prompts(1, 30, 30, seed=10)[0]
    deltas = await collect(engine, prompt, greedy(40), "delta")
    (final,) = await collect(engine, prompt, greedy(40, RequestOutputKind.FINAL_ONLY), "final")
    assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].text for d in deltas) == final.outputs[0].text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == final.outputs[0].token_ids
    cumulative = await collect(engine, prompt, greedy(40, RequestOutputKind.CUMULATIVE), "cumulative")
    assert cumulative[-1].outputs[0].token_ids == final.outputs[0].token_ids


async def test_200_streams_with_a_third_cancelled(engine: AsyncLLM, tiny_llama_hf_dir: Path) -> None:
    prompts = random_prompts(200, 5, 120, seed=11)
    rng = random.Random(12)
    params = [greedy(rng.randint(4, 40)) for _ in prompts]
    cancelled = set(rng.sample(range(200), 66))
    offline = LLM(model=str(tiny_llama_hf_dir), kv_cache_memory=8 << 20, multiprocess=False)
    expected = offline.generate(
        prompts, [p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params], use_tqdm=False
    )
    offline.shutdown()

    async def stream(i: int) -> list[int] | None:
        tokens: list[int] = []
        async for out in engine.generate(prompts[i], params[i], f"req-{i}"):
            tokens.extend(out.outputs[0].token_ids)
            if i in cancelled and len(tokens) >= 2:
                return None  # leaving the loop closes the generator, which aborts the request
        return tokens

    tasks = [asyncio.create_task(stream(i)) for i in range(200)]
    await asyncio.sleep(0.2)
    for i in list(cancelled)[:20]:  # cancel some tasks outright, too
        tasks[i].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i, result in enumerate(results):
        if i not in cancelled:
            assert result == expected[i].outputs[0].token_ids, f"stream {i}"
    await assert_core_is_empty(engine)
    assert not engine.output_processor.has_unfinished_requests()


async def test_slow_consumer_still_gets_every_token(engine: AsyncLLM) -> None:
    prompt = random_prompts(1, 10, 10, seed=13)[0]
    (final,) = await collect(engine, prompt, greedy(60, RequestOutputKind.FINAL_ONLY), "fast")
    tokens: list[int] = []
    text = ""
    reads = 0
    async for out in engine.generate(prompt, greedy(60), "slow"):
        tokens.extend(out.outputs[0].token_ids)
        text += out.outputs[0].text
        reads += 1
        await asyncio.sleep(0.05)
    assert tokens == final.outputs[0].token_ids and text == final.outputs[0].text
    assert reads < 60  # outputs were merged while the consumer slept


async def test_n4_seeded_distinct_reproducible_and_abortable(engine: AsyncLLM) -> None:
    prompt = random_prompts(1, 12, 12, seed=14)[0]
    params = SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY
    )
    (first,) = await collect(engine, prompt, params, "n4-a")
    (again,) = await collect(engine, prompt, params, "n4-b")
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 4
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]

    streaming = params.clone(output_kind=RequestOutputKind.DELTA, max_tokens=400)
    seen: set[int] = set()
    async for out in engine.generate(prompt, streaming, "n4-abort"):
        seen.update(c.index for c in out.outputs)
        if len(seen) == 4:
            await engine.abort("n4-abort")
            break
    await assert_core_is_empty(engine)


async def test_bad_input_fails_before_the_core_and_others_continue(engine: AsyncLLM) -> None:
    prompt = random_prompts(1, 10, 10, seed=15)[0]
    good = asyncio.create_task(collect(engine, prompt, greedy(30), "good"))
    with pytest.raises(ValueError, match="max_model_len"):
        await collect(engine, {"prompt_token_ids": [5] * 5000}, greedy(4), "too-long")
    with pytest.raises(ValueError, match="temperature"):
        await collect(engine, prompt, SamplingParams(temperature=-1), "bad-temp")
    outputs = await good
    assert outputs[-1].finished and len([t for o in outputs for t in o.outputs[0].token_ids]) == 30


async def test_killed_core_fails_every_stream_fast(tiny_llama_hf_dir: Path) -> None:
    engine = make_engine(tiny_llama_hf_dir)
    prompt = random_prompts(1, 10, 10, seed=16)[0]
    long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    streams = [engine.generate(prompt, long, f"doomed-{i}") for i in range(4)]
    for stream in streams:  # killed once every request runs (a fixed sleep let a fast core finish them)
        await anext(stream)
    os.kill(engine.engine_core.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    start = time.monotonic()
    for stream in streams:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(drain(stream), timeout=5)
    assert time.monotonic() - start < 5
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        await collect(engine, prompt, long, "after")
    assert time.monotonic() - start < 1
    engine.shutdown()


async def test_shutdown_leaves_no_core_process(tiny_llama_hf_dir: Path) -> None:
    engine = make_engine(tiny_llama_hf_dir)
    proc = engine.engine_core.proc  # type: ignore[attr-defined]
    await collect(engine, random_prompts(1, 5, 5)[0], greedy(4), "one")
    engine.shutdown()
    assert proc.poll() is not None
