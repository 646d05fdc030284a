"""Latency: streaming TTFT / time per output token through `AsyncLLM` at several concurrencies, the cost
of the process hop (core in its own process vs in-process), and single-stream decode speed with the
memory bandwidth it achieves against this machine's measured peak.

    .venv/bin/python benchmarks/latency.py                 # everything
    .venv/bin/python benchmarks/latency.py --only decode   # one section: async, hop or decode
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch

from benchmarks.machine import warn_if_busy
from llmserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream_once(engine: AsyncLLM, prompt: list[int], output_len: int, rid: str) -> tuple[float, float]:
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    start = time.perf_counter()
    first = last = 0.0
    async for _ in engine.generate({"prompt_token_ids": prompt}, params, rid):
        last = time.perf_counter()
        if not first:
            first = last
    return first - start, (last - first) / max(output_len - 1, 1)


async def async_section(args: argparse.Namespace) -> None:
    engine = AsyncLLM(model=args.model, log_stats=False)
    rng = random.Random(0)
    await stream_once(engine, [rng.randrange(100, 40000) for _ in range(8)], 4, "warmup")
    print(f"AsyncLLM streaming (input {args.input_len}, output {args.output_len} tokens)")
    for concurrency in (1, 8, 32):
        prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(concurrency)]
        results = await asyncio.gather(
            *(stream_once(engine, p, args.output_len, f"c{concurrency}-{i}") for i, p in enumerate(prompts))
        )
        ttft = [r[0] * 1e3 for r in results]
        tpot = [r[1] * 1e3 for r in results]
        print(
            f"  concurrency {concurrency:>2}: TTFT p50 {percentile(ttft, 0.5):7.1f} ms, "
            f"p99 {percentile(ttft, 0.99):7.1f} ms; TPOT p50 {percentile(tpot, 0.5):6.1f} ms, "
            f"p99 {percentile(tpot, 0.99):6.1f} ms"
        )
    engine.shutdown()


def hop_section(args: argparse.Namespace) -> None:
    """Same decode-heavy batch of 8 through LLM with the core in-process and in its own process."""
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(16)]} for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    times = {}
    for multiprocess in (False, True):
        llm = LLM(model=args.model, multiprocess=multiprocess)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            runs.append((time.perf_counter() - start) / args.output_len)
        times[multiprocess] = min(runs)
        llm.shutdown()
    overhead = times[True] / times[False] - 1
    print(
        f"process hop at batch 8: {times[False] * 1e3:.1f} ms/step in-process, "
        f"{times[True] * 1e3:.1f} ms/step over ZMQ: {overhead * 100:+.1f}% per step"
    )


def measured_bandwidth() -> float:
    """Read bandwidth in GB/s: summing a buffer far larger than the caches, with the engine's threads."""
    buf = torch.ones(256 << 20, dtype=torch.float32)  # 1 GiB
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(5))
    return buf.numel() * 4 / best / 1e9


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def decode_section(args: argparse.Namespace) -> None:
    peak = measured_bandwidth()
    print(f"single-stream decode (machine read bandwidth {peak:.1f} GB/s, {torch.get_num_threads()} threads)")
    for dtype in args.dtypes.split(","):
        llm = LLM(model=args.model, dtype=dtype, multiprocess=False)
        runner = llm.llm_engine.engine_core.engine_core.model_runner  # type: ignore[attr-defined]
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        prompt = {"prompt_token_ids": list(range(100, 100 + args.input_len))}
        llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            runs.append(time.perf_counter() - start)
        tok_s = args.output_len / statistics.median(runs)
        achieved = weight_bytes * tok_s / 1e9
        print(
            f"  {dtype:>9}: {tok_s:6.1f} tok/s; weights {weight_bytes / 1e6:.0f} MB → {achieved:.1f} GB/s, "
            f"{achieved / peak * 100:.0f}% of peak (roofline {peak * 1e9 / weight_bytes:.0f} tok/s)"
        )
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--only", choices=["async", "hop", "decode"])
    args = parser.parse_args()
    warn_if_busy()
    if args.only in (None, "async"):
        asyncio.run(async_section(args))
    if args.only in (None, "hop"):
        hop_section(args)
    if args.only in (None, "decode"):
        decode_section(args)


if __name__ == "__main__":
    main()
