"""Soak: resident memory, the queue and the KV cache under a long, mixed load, in one of two modes.

By count (the default): --num-requests requests (2,000) of mixed shapes, --concurrency at a time; the
server's processes' resident memory is sampled after the first 100 (the KV pool faulted in before the
first) and every --sample-every after, and the run passes when the last sample is within --tolerance
(10%) of the first. A server that leaks per request (a request's blocks, its detokenizer, its
collector, a dropped stream's state) grows with every one of them.

By time (--duration SECONDS): an open-loop load at --overload (2) times the capacity a short probe
measures first (or at --rate requests/s), so the queue builds; see benchmarks/common/soak_duration.py.

    .venv/bin/python -m benchmarks.soak                                  # the default model
    .venv/bin/python -m benchmarks.soak --model qwen2.5-coder-0.5b-instruct --num-requests 500
    .venv/bin/python -m benchmarks.soak --duration 1200 --json benchmarks/results/soak.json

The shapes, drawn from a seeded generator (benchmarks/common/soak_mix.py): completions and chat completions,
streamed or not; prompts of 2-400 words, and now and then one near --max-model-len; 1-48 output
tokens; n = 2 now and then, logprobs now and then; some streams dropped by the client after their
first chunk (the server must abort them); some requests invalid (a 400 expected). After the load,
once the server is idle, its /metrics must show no request running or waiting and no KV block in use.
Exits 1 when memory grew beyond the tolerance, a request met an unexpected status, or a request or
block is left in the server.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
import psutil

from benchmarks.common.machine import warn_if_busy
from benchmarks.common.results import add_json_arg, write_results
from benchmarks.common.servers import free_port, llmserve_command, running
from benchmarks.common.soak_duration import add_duration_args, run_for_duration
from benchmarks.common.soak_mix import (
    SHED,
    Shape,
    draw_shape,
    long_prompt_ids,
    parse_gauges,
    process_rss,
    send,
)

DEFAULT_MODEL = "smollm2-135m-instruct"
WARMUP_REQUESTS = 100


@dataclass
class Sample:
    completed: int
    rss: int
    by_process: dict[str, int] = field(default_factory=dict)


async def soak(args: argparse.Namespace, base_url: str, server_pid: int) -> tuple[list[Sample], list[str]]:
    rng = random.Random(args.seed)
    long_prompt = long_prompt_ids(base_url)
    shapes = [draw_shape(rng, args.model, long_prompt) for _ in range(args.num_requests)]
    samples: list[Sample] = []
    errors: list[str] = []
    completed = 0
    limit = asyncio.Semaphore(args.concurrency)
    connections = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=connections) as http:

        async def one(shape: Shape) -> None:
            nonlocal completed
            async with limit:
                error = await send(http, base_url, shape)
            if error and error != SHED:
                errors.append(error)
            completed += 1
            if (
                completed == WARMUP_REQUESTS
                or (completed > WARMUP_REQUESTS and (completed - WARMUP_REQUESTS) % args.sample_every == 0)
                or completed == len(shapes)
            ):
                by_process = process_rss(server_pid)
                samples.append(Sample(completed, sum(by_process.values()), by_process))
                print(f"{completed:5d} requests: {samples[-1].rss / 2**20:7.1f} MiB", flush=True)

        await asyncio.gather(*(one(s) for s in shapes))
    return samples, errors


def settled_rss(pid: int, timeout_s: float = 120.0) -> int:
    """The resident memory of a server or an `LLM`'s process (`pid`) and its engine core, once it stops
    growing while idle: the KV pool is faulted in by a thread in the idle scheduling class after start-up
    (model_executor/host_memory.py), seconds to half a minute on an idle machine, but held back by a load
    that starts at once and keeps every core busy, which would read as growth under load."""
    deadline = time.monotonic() + timeout_s
    last = sum(process_rss(pid).values())
    while time.monotonic() < deadline:
        time.sleep(2.0)
        now = sum(process_rss(pid).values())
        if now - last < 0.005 * last:
            return now
        last = now
    return last


def idle_metrics(base_url: str, wait_s: float = 10.0) -> dict[str, float]:
    """The server's running, waiting and KV-usage gauges once they read zero, or as they stand after
    wait_s."""
    root = base_url.removesuffix("/v1")
    deadline = time.monotonic() + wait_s
    while True:
        gauges = parse_gauges(httpx.get(f"{root}/metrics", timeout=10).text)
        if not any(gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


def memory_growth(samples: list[Sample]) -> float:
    """Resident memory's growth from the first sample after the warm-up requests to the last: what
    the server allocates once (pools, caches, the allocator's arenas) it has allocated by then."""
    first = next(s for s in samples if s.completed >= WARMUP_REQUESTS)
    return samples[-1].rss / first.rss - 1


def failures(growth: float, tolerance: float, errors: list[str], gauges: dict[str, float]) -> list[str]:
    """Why the run fails, or nothing when it passes: memory grew more than `tolerance`, a request met
    an unexpected answer, or requests are still running or waiting (or KV blocks in use) once the
    server is idle."""
    reasons = []
    if growth > tolerance:
        reasons.append(f"resident memory grew {growth:+.1%}, more than {tolerance:.0%}")
    if errors:
        reasons.append(f"unexpected answers: {len(errors)}")
    if any(gauges.values()):
        reasons.append(f"requests or KV blocks left in the server: {gauges}")
    return reasons


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=1024, help="the server's; long prompts near it")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="the server's, in bytes")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16, help="by count; and the capacity probe's")
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed growth after the warm-up")
    parser.add_argument("--seed", type=int, default=0)
    overload = parser.add_argument_group(
        "the server's overload control (a 503 it sends is counted as shed load, not as an error)"
    )
    overload.add_argument("--max-num-seqs", type=int, default=None)
    overload.add_argument("--max-num-queued-requests", type=int, default=None)
    overload.add_argument("--max-queue-time", type=float, default=None, help="seconds")
    add_duration_args(parser)
    add_json_arg(parser)
    return parser.parse_args(argv)


def run_for_count(args: argparse.Namespace, command: list[str], port: int, foreign_load: float) -> list[str]:
    """The count mode: prints and writes its figures, returns why it failed (nothing if it passed)."""
    start = time.perf_counter()
    with running("llmserve", command, port) as url:
        pid = next(p.pid for p in psutil.Process().children() if str(port) in p.cmdline())
        settled = settled_rss(pid)
        print(f"resident {settled / 2**20:.1f} MiB once settled, before the first request", flush=True)
        samples, errors = asyncio.run(soak(args, url, pid))
        gauges = idle_metrics(url)
    duration = time.perf_counter() - start
    first, last = samples[0], samples[-1]
    growth = memory_growth(samples)
    for error in sorted(set(errors))[:10]:
        print(f"request failed: {error}", file=sys.stderr)
    print(f"{args.num_requests} requests in {duration:.0f} s; resident {first.rss / 2**20:.1f} MiB after "
          f"{first.completed}, {last.rss / 2**20:.1f} MiB after {last.completed} ({growth:+.1%}); "
          f"{len(errors)} unexpected answers; idle gauges {gauges}")  # fmt: skip
    write_results(
        args.json,
        "benchmarks.soak",
        {
            "mode": "count",
            "model": args.model,
            "num_requests": args.num_requests,
            "concurrency": args.concurrency,
            "duration_s": duration,
            "growth": growth,
            "unexpected": len(errors),
            "idle_gauges": gauges,
            "samples": [asdict(s) for s in samples],
        },
        foreign_load,
    )
    return failures(growth, args.tolerance, errors, gauges)


def main() -> None:
    args = parse_args()
    if args.duration is None and args.num_requests <= WARMUP_REQUESTS:
        sys.exit(f"--num-requests must exceed the {WARMUP_REQUESTS} warm-up requests")
    foreign_load = warn_if_busy()
    port = free_port()
    command = [*llmserve_command(args.model, port, args.dtype), "--max-model-len", str(args.max_model_len)]
    for flag in ("kv_cache_memory", "max_num_seqs", "max_num_queued_requests", "max_queue_time"):
        if getattr(args, flag) is not None:
            command += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    if args.duration is not None:
        reasons = run_for_duration(args, command, port, foreign_load)
    else:
        reasons = run_for_count(args, command, port, foreign_load)
    if reasons:
        sys.exit("soak failed: " + "; ".join(reasons))


if __name__ == "__main__":
    main()
