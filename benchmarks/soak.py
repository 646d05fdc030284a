"""Soak: resident memory under a long, mixed load. Our server takes --num-requests requests (2,000 by
default) of mixed shapes, --concurrency at a time; the server's processes' resident memory is sampled
after the first 100 and every --sample-every after, and the run passes when the last sample is within
--tolerance (10%) of the first. A server that leaks per request (a request's blocks, its detokenizer,
its collector, a dropped stream's state) grows with every one of them.

    .venv/bin/python -m benchmarks.soak                                  # the default model
    .venv/bin/python -m benchmarks.soak --model qwen2.5-coder-0.5b-instruct --num-requests 500

The shapes, drawn from a seeded generator: completions and chat completions, streamed or not; prompts
of 2-400 words; 1-48 output tokens; n = 2 now and then, logprobs now and then; some streams dropped
by the client after their first chunk (the server must abort them); some requests invalid (a 400
expected). After the load, once the server is idle, its /metrics must show no request running.
Exits 1 when memory grew beyond the tolerance, a request met an unexpected status, or a request is
left running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
import psutil

from benchmarks.machine import warn_if_busy
from benchmarks.results import add_json_arg, write_results
from benchmarks.servers import free_port, llmserve_command, running
from benchmarks.serving import WORDS

DEFAULT_MODEL = "smollm2-135m-instruct"
WARMUP_REQUESTS = 100


@dataclass(frozen=True)
class Shape:
    """One request of the mix: the endpoint, its body and what the client does with the answer."""

    path: str
    body: dict[str, object]
    expect_status: int
    drop_after_first_chunk: bool


def draw_shape(rng: random.Random, model: str) -> Shape:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 400)))
    stream = rng.random() < 0.6
    body: dict[str, object] = {
        "model": model,
        "max_tokens": rng.randint(1, 48),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": stream,
    }
    if rng.random() < 0.5:
        path, body["prompt"] = "/completions", words
        if rng.random() < 0.2:
            body["logprobs"] = 3
    else:
        path, body["messages"] = "/chat/completions", [{"role": "user", "content": words}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, 3
    if rng.random() < 0.1:
        body["n"] = 2
    expect = 200
    if rng.random() < 0.05:
        body["max_tokens"], expect = -1, 400
    drop = stream and expect == 200 and rng.random() < 0.1
    return Shape(path, body, expect, drop)


async def send(http: httpx.AsyncClient, base_url: str, shape: Shape) -> str | None:
    """Sends one request; returns what went wrong, or None."""
    try:
        async with http.stream("POST", base_url + shape.path, json=shape.body) as response:
            if response.status_code != shape.expect_status:
                body = (await response.aread())[:200]
                return f"HTTP {response.status_code} (expected {shape.expect_status}): {body!r}"
            if not shape.body["stream"] or response.status_code != 200:
                await response.aread()
                return None
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if "error" in json.loads(line.removeprefix("data: ")):
                        return f"error in stream: {line[:200]}"
                    if shape.drop_after_first_chunk:
                        return None  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        return repr(e)
    return None


def tree_rss(pid: int) -> dict[str, int]:
    """Resident bytes of the server and each of its child processes (the engine core among them)."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    return {f"{p.pid} {' '.join(p.cmdline()[1:4])[:60]}": p.memory_info().rss for p in procs}


@dataclass
class Sample:
    completed: int
    rss: int
    by_process: dict[str, int] = field(default_factory=dict)


async def soak(args: argparse.Namespace, base_url: str, server_pid: int) -> tuple[list[Sample], list[str]]:
    rng = random.Random(args.seed)
    shapes = [draw_shape(rng, args.model) for _ in range(args.num_requests)]
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
            if error:
                errors.append(error)
            completed += 1
            if (
                completed == WARMUP_REQUESTS
                or (completed > WARMUP_REQUESTS and (completed - WARMUP_REQUESTS) % args.sample_every == 0)
                or completed == len(shapes)
            ):
                by_process = tree_rss(server_pid)
                samples.append(Sample(completed, sum(by_process.values()), by_process))
                print(f"{completed:5d} requests: {samples[-1].rss / 2**20:7.1f} MiB", flush=True)

        await asyncio.gather(*(one(s) for s in shapes))
    return samples, errors


def idle_metrics(base_url: str, wait_s: float = 10.0) -> dict[str, float]:
    """The server's running/waiting gauges once they read zero, or as they stand after wait_s."""
    root = base_url.removesuffix("/v1")
    deadline = time.monotonic() + wait_s
    while True:
        text = httpx.get(f"{root}/metrics", timeout=10).text
        gauges = {
            name: float(value)
            for name, value in re.findall(
                r"^llmserve:(num_requests_running|num_requests_waiting)\{[^}]*\} (\S+)$", text, re.M
            )
        }
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
    an unexpected answer, or requests are still running or waiting once the server is idle."""
    reasons = []
    if growth > tolerance:
        reasons.append(f"resident memory grew {growth:+.1%}, more than {tolerance:.0%}")
    if errors:
        reasons.append(f"unexpected answers: {len(errors)}")
    if any(gauges.values()):
        reasons.append(f"requests left in the server: {gauges}")
    return reasons


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--tolerance", type=float, default=0.10, help="allowed growth after the first 100")
    parser.add_argument("--seed", type=int, default=0)
    add_json_arg(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.num_requests <= WARMUP_REQUESTS:
        sys.exit(f"--num-requests must exceed the {WARMUP_REQUESTS} warm-up requests")
    foreign_load = warn_if_busy()
    port = free_port()
    command = llmserve_command(args.model, port, args.dtype)
    start = time.perf_counter()
    with running("llmserve", command, port) as url:
        pid = next(p.pid for p in psutil.Process().children() if str(port) in p.cmdline())
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
    reasons = failures(growth, args.tolerance, errors, gauges)
    if reasons:
        sys.exit("soak failed: " + "; ".join(reasons))


if __name__ == "__main__":
    main()
