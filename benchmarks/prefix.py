"""Prefix caching: 64 requests share a seeded 512-token system prompt, each followed by its own short
user suffix, streamed through `AsyncLLM` with prefix caching on and then off (a fresh engine each).

    .venv/bin/python -m benchmarks.prefix
    .venv/bin/python -m benchmarks.prefix --num-requests 16 --concurrency 4 --json out.json

The first request runs alone: with caching on it fills the cache (its TTFT is a cold prefill in both
modes and is printed apart). The other requests then stream with at most --concurrency in flight; TTFT
is timed per request from submission to its first streamed token, so it includes waiting in the engine
behind the other requests in flight, as a client sees it. Sampling is greedy with ignore_eos and
--output-len tokens, so both modes should produce the same tokens; the count that match is printed.
The hit rate is the engine's own: prompt tokens found cached over prompt tokens looked up
(`SchedulerStats`). Target (issue 6): TTFT with caching <= 1/3 of without.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import numpy as np

from benchmarks.common.machine import warn_if_busy
from benchmarks.common.results import add_json_arg, write_results
from llmserve import AsyncLLM, RequestOutputKind, SamplingParams
from llmserve.contracts import SchedulerStats
from llmserve.engine.input_processor import TokensPrompt
from llmserve.metrics.stats import IterationStats


class StatsProbe:
    """A stat logger that keeps the core's latest `SchedulerStats` (its prefix-cache counters are
    cumulative, so two snapshots bracket a run)."""

    def __init__(self) -> None:
        self.latest = SchedulerStats()

    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats, engine_index: int = 0
    ) -> None:
        if scheduler_stats is not None:
            self.latest = scheduler_stats

    def maybe_log(self) -> None:
        pass


@dataclass(frozen=True)
class ModeResult:
    caching: bool
    first_ttft: float  # seconds: the request that ran alone
    ttfts: list[float]  # seconds: the others
    wall: float  # seconds: all requests, first included
    hit_rate: float
    outputs: list[list[int]]

    def summary(self) -> dict[str, float]:
        ms = [t * 1e3 for t in self.ttfts]
        return {
            "first_ttft_ms": self.first_ttft * 1e3,
            "ttft_p50_ms": float(np.percentile(ms, 50)),
            "ttft_p99_ms": float(np.percentile(ms, 99)),
            "ttft_mean_ms": statistics.fmean(ms),
            "wall_s": self.wall,
            "hit_rate": self.hit_rate,
        }


def make_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(100, vocab_size) for _ in range(args.prefix_len)]
    return [
        system
        + [rng.randrange(100, vocab_size) for _ in range(rng.randint(args.min_suffix, args.max_suffix))]
        for _ in range(args.num_requests)
    ]


async def timed_stream(
    engine: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str
) -> tuple[float, list[int]]:
    """(TTFT in seconds, the generated token ids)."""
    start, ttft, tokens = time.perf_counter(), 0.0, []
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, rid):
        ttft = ttft or time.perf_counter() - start
        tokens.extend(out.outputs[0].token_ids)
    return ttft, tokens


async def run_mode(args: argparse.Namespace, prompts: list[list[int]], caching: bool) -> ModeResult:
    probe = StatsProbe()
    engine = AsyncLLM(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=caching,
        log_stats=False,
        stat_loggers=[probe],
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    await timed_stream(engine, prompts[0][-8:], SamplingParams(max_tokens=2), "warmup")
    before, limit = probe.latest, asyncio.Semaphore(args.concurrency)

    async def limited(i: int) -> tuple[float, list[int]]:
        async with limit:
            return await timed_stream(engine, prompts[i], params, str(i))

    start = time.perf_counter()
    first = await timed_stream(engine, prompts[0], params, "0")
    rest = await asyncio.gather(*(limited(i) for i in range(1, len(prompts))))
    wall = time.perf_counter() - start
    after = probe.latest
    engine.shutdown()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hit_rate = (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0
    return ModeResult(
        caching, first[0], [t for t, _ in rest], wall, hit_rate, [first[1]] + [o for _, o in rest]
    )


def report(on: ModeResult, off: ModeResult) -> dict[str, object]:
    """Print both modes side by side with on/off ratios; return the figures for the results file."""
    a, b = on.summary(), off.summary()
    print(f"{'':22}{'caching on':>12}{'caching off':>13}{'on/off':>9}")
    for key in a:
        ratio = f"{a[key] / b[key]:8.2f}x" if b[key] else ""
        print(f"{key:22}{a[key]:12.2f}{b[key]:13.2f} {ratio}")
    same = sum(x == y for x, y in zip(on.outputs, off.outputs))
    print(f"identical outputs: {same}/{len(on.outputs)}")
    verdict = "meets" if a["ttft_p50_ms"] <= b["ttft_p50_ms"] / 3 else "misses"
    print(f"TTFT p50 on/off {a['ttft_p50_ms'] / b['ttft_p50_ms']:.2f} {verdict} the target (<= 0.33)")
    return {"on": a, "off": b, "identical_outputs": same}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of the shared system prompt")
    parser.add_argument("--min-suffix", type=int, default=8)
    parser.add_argument("--max-suffix", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight after the first")
    parser.add_argument("--seed", type=int, default=0)
    add_json_arg(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    load = warn_if_busy()
    from llmserve.model_executor.loader import resolve_model
    from llmserve.model_executor.loader.weights import load_model_config

    prompts = make_prompts(args, load_model_config(resolve_model(args.model)).vocab_size)
    print(
        f"{len(prompts)} requests: {args.prefix_len}-token shared prefix + {args.min_suffix}-"
        f"{args.max_suffix} own tokens, {args.output_len} output tokens, concurrency {args.concurrency}"
    )
    on = asyncio.run(run_mode(args, prompts, caching=True))
    off = asyncio.run(run_mode(args, prompts, caching=False))
    results = report(on, off)
    results.update(
        num_requests=len(prompts),
        prefix_len=args.prefix_len,
        concurrency=args.concurrency,
        output_len=args.output_len,
        model=args.model,
    )
    write_results(args.json, "benchmarks.prefix", results, load)


if __name__ == "__main__":
    main()
