"""Serving benchmark: a fixed, seeded streaming load at several concurrencies (1, 8 and 32 streams by
default) against our OpenAI-compatible server and, on the same GGUF, against llama-cpp-python's server
(`--compare-llama-cpp`) and llama.cpp's own `llama-server` (`--llama-server PATH`), in one run.

    .venv/bin/python -m benchmarks.serving                       # starts `llmserve serve` itself
    .venv/bin/python -m benchmarks.serving --compare-llama-cpp \\
        --llama-cpp-python $LLAMA_CPP_PYTHON
    .venv/bin/python -m benchmarks.serving --llama-server $LLAMA_CPP_BIN/llama-server
    .venv/bin/python -m benchmarks.serving --base-url http://127.0.0.1:8000/v1 --concurrency 8
    .venv/bin/python -m benchmarks.serving --data-parallel-size 2 1 --concurrency 32

`--data-parallel-size 2 1` starts our server twice, one after the other: with 2 engine-core ranks, then
with 1, each rank computing with the cores divided among the ranks (`--num-threads`); the first is
compared with the others. For each of our servers it also reports the resident memory of its process
tree after the load: RSS summed over the processes (pages they share, such as the mapped weights,
counted in each) and PSS summed (shared pages split among them: what the setup really holds).

Without --base-url it starts our server on a free port; each server is stopped before the next starts,
so no two share the cores. At each concurrency C, C streams each send --requests-per-stream requests
back to back (or --num-prompts in all). Per level it prints time to first token (p50, p99),
inter-token latency (p50 of the gaps between streamed chunks), output tokens/s and requests/s, and our
ratio to each peer. Prompts are random common words, about one token each. llama-cpp-python's server
runs one request at a time (its API holds a lock), so its TTFT grows with the queue; that is its
behaviour under this load, not a fault here. llama-server gets as many slots as the largest
concurrency, batched continuously, so it never queues a stream.

Every level above is timed after a warm-up request. Before them (unless --no-cold), each server gets
the largest level once more, with prompts of another seed, sent the moment it answers: no warm-up. That
first load reports the server's start-up (launch to answering), its rates, and the seconds from
launching the server to the load's last token: what a user who starts a server and sends work waits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil

from benchmarks.common.machine import warn_if_busy
from benchmarks.common.peers import engine_threads, executable, gguf_of, interpreter_with
from benchmarks.common.results import add_json_arg, write_results
from benchmarks.common.servers import (
    free_port,
    llama_cpp_command,
    llama_server_command,
    llmserve_command,
    running,
)

# fmt: off
WORDS = [
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye",
    "woman", "place", "work", "week", "case", "point", "company", "number", "group", "problem", "fact",
    "house", "river", "music", "story", "water", "light", "city", "road", "tree", "paper", "table",
]
# fmt: on
DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    concurrency: int
    input_len: int
    output_len: int
    seed: int

    def prompts(self) -> list[str]:
        rng = random.Random(self.seed)
        return [" ".join(rng.choice(WORDS) for _ in range(self.input_len)) for _ in range(self.num_prompts)]


@dataclass
class RequestResult:
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class Report:
    name: str
    completed: int
    failed: int
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    output_tokens_per_s: float
    requests_per_s: float
    memory_gib: dict[str, float] = field(default_factory=dict)  # of our server's processes, after the load
    startup_s: float | None = None  # a fresh server's first load: launch to answering,
    launch_to_last_s: float | None = None  # and launch to the load's last token

    @classmethod
    def of(cls, name: str, results: list[RequestResult], duration: float) -> Report:
        ok = [r for r in results if r.error is None and r.ttft is not None]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        itls = [gap for r in ok for gap in r.itls]
        return cls(
            name=name,
            completed=len(ok),
            failed=len(results) - len(ok),
            ttft_p50=float(np.percentile(ttfts, 50)) if ttfts else float("nan"),
            ttft_p99=float(np.percentile(ttfts, 99)) if ttfts else float("nan"),
            itl_p50=float(np.percentile(itls, 50)) if itls else float("nan"),
            output_tokens_per_s=sum(r.output_tokens for r in ok) / duration,
            requests_per_s=len(ok) / duration,
        )

    def rows(self) -> dict[str, float]:
        return {
            "TTFT p50 (ms)": self.ttft_p50 * 1e3,
            "TTFT p99 (ms)": self.ttft_p99 * 1e3,
            "ITL p50 (ms)": self.itl_p50 * 1e3,
            "output tokens/s": self.output_tokens_per_s,
            "requests/s": self.requests_per_s,
            **{f"{kind} (GiB)": gib for kind, gib in self.memory_gib.items()},
            **({} if self.startup_s is None else {"start-up (s)": self.startup_s}),
            **({} if self.launch_to_last_s is None else {"launch to last (s)": self.launch_to_last_s}),
        }


async def stream_one(
    http: httpx.AsyncClient,
    base_url: str,
    model: str,
    prompt: str,
    n: int,
    extra: dict[str, Any] | None = None,
) -> RequestResult:
    """One streamed completion of `n` tokens; `extra`: more body fields (benchmarks/structured.py's)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,  # a vLLM extension; servers without it may stop early (counted as they stop)
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    result, chunks = RequestResult(), 0
    start = last = time.perf_counter()
    try:
        async with http.stream("POST", f"{base_url}/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    result.error = str(chunk["error"])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(choice.get("text") for choice in chunk.get("choices") or []):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last, chunks = now, chunks + 1
    except httpx.HTTPError as e:
        result.error = repr(e)
    result.output_tokens = result.output_tokens or chunks  # no usage sent: one token per chunk
    return result


async def run_workload(
    name: str, base_url: str, model: str, workload: Workload, warm_up: bool = True
) -> Report:
    limit = asyncio.Semaphore(workload.concurrency)
    # A connection per request: llama-server drops a reused keep-alive connection now and then (about 1
    # request in 14 back to back, "Server disconnected without sending a response"); a local connect
    # costs every server the same fraction of a millisecond.
    connections = httpx.Limits(max_connections=workload.concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=connections) as http:

        async def limited(prompt: str) -> RequestResult:
            async with limit:
                return await stream_one(http, base_url, model, prompt, workload.output_len)

        if warm_up:
            await stream_one(http, base_url, model, "Warm up.", 2)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in workload.prompts()))
        duration = time.perf_counter() - start
    for error in {r.error for r in results if r.error}:
        print(f"[{name}] request failed: {error}", file=sys.stderr)
    return Report.of(name, list(results), duration)


def run_levels(name: str, base_url: str, model: str, levels: list[Workload]) -> list[Report]:
    return [asyncio.run(run_workload(name, base_url, model, workload)) for workload in levels]


def discover_model(base_url: str) -> str:
    return str(httpx.get(f"{base_url}/models", timeout=30).json()["data"][0]["id"])


def serve(
    name: str,
    command: list[str],
    port: int,
    levels: list[Workload],
    ready: str = "/v1/models",
    measure_memory: bool = False,
    cold: Workload | None = None,
) -> list[Report]:
    """Start a server, run `cold` the moment it answers (its report first, with its start-up), then every
    level (then read its memory, where asked), and stop it."""
    launched = time.perf_counter()
    with running(name, command, port, ready) as url:
        model = discover_model(url)
        first = []
        if cold is not None:
            startup = time.perf_counter() - launched
            report = asyncio.run(run_workload(name, url, model, cold, warm_up=False))
            launch_to_last = time.perf_counter() - launched
            first = [dataclasses.replace(report, startup_s=startup, launch_to_last_s=launch_to_last)]
        reports = run_levels(name, url, model, levels)
        if measure_memory:
            memory = tree_memory(port)
            reports = [dataclasses.replace(r, memory_gib=memory) for r in reports]
        return first + reports


def tree_memory(port: int) -> dict[str, float]:
    """RSS and PSS, in GiB, summed over the server listening on `port` and its children (engine cores)."""
    server = next(p for p in psutil.Process().children() if str(port) in p.cmdline())
    processes = [server, *server.children(recursive=True)]
    return {
        "RSS": sum(p.memory_info().rss for p in processes) / 2**30,
        "PSS": sum(p.memory_full_info().pss for p in processes) / 2**30,
    }


def ours(
    args: argparse.Namespace, levels: list[Workload], cold: Workload | None
) -> tuple[str, list[list[Report]]]:
    """Against --base-url if given (nothing cold to time), else against a server we start and stop (one
    per data-parallel size asked for). Returns the model too."""
    if args.base_url:
        url = args.base_url.rstrip("/")
        model = args.model or discover_model(url)
        return model, [run_levels("llmserve", url, model, levels)]
    model = args.model or DEFAULT_MODEL
    runs = []
    for size in args.data_parallel_size or [None]:
        port = free_port()
        command = llmserve_command(model, port, args.dtype, args.quantization, args.kv_cache_dtype)
        name = "llmserve"
        if size is not None:
            threads = max(1, engine_threads() // size)
            command += ["--data-parallel-size", str(size), "--num-threads", str(threads)]
            name = f"llmserve DP={size}x{threads}t"
        runs.append(serve(name, command, port, levels, measure_memory=True, cold=cold))
    return model, runs


def peers(
    args: argparse.Namespace, model: str, levels: list[Workload], cold: Workload | None
) -> list[list[Report]]:
    """The llama.cpp servers asked for, one after another, on the served model's GGUF; one that cannot
    run is skipped with the reason."""
    if not (args.compare_llama_cpp or args.llama_server):
        return []
    gguf = Path(args.gguf) if args.gguf else gguf_of(model)
    if gguf is None:
        print("no llama.cpp comparison: no GGUF (pass --gguf FILE).")
        return []
    context, threads = 2 * (args.input_len + args.output_len) + 64, engine_threads()  # words may be 2 tokens
    reports = []
    if args.compare_llama_cpp:
        python = interpreter_with("llama_cpp", args.llama_cpp_python)
        if python is None:
            why = "not installed (pass --llama-cpp-python PATH, with its [server] extra)"
            print(f"no llama-cpp-python comparison: {why}.")
        else:
            port = free_port()
            command = llama_cpp_command(python, gguf, port, context, threads)
            reports.append(serve("llama-cpp", command, port, levels, cold=cold))
    if args.llama_server:
        port, slots = free_port(), max(args.concurrency)
        command = llama_server_command(args.llama_server, gguf, port, slots, context, threads)
        reports.append(serve("llama-server", command, port, levels, ready="/health", cold=cold))
    return reports


def print_reports(reports: list[Report]) -> None:
    """One column per server, then our ratio to each peer."""
    ours, others = reports[0], reports[1:]
    ratios = [f"{ours.name}/{r.name}" for r in others]
    print(f"{'':18}" + "".join(f"{r.name:>14}" for r in reports) + "".join(f"{n:>24}" for n in ratios))
    for key, value in ours.rows().items():
        theirs = [r.rows().get(key) for r in others]  # only our servers' memory is read
        line = f"{key:18}" + "".join(
            f"{v:14.2f}" if v is not None else f"{'-':>14}" for v in [value, *theirs]
        )
        print(line + "".join(f"{value / v:23.2f}x" if v else f"{'-':>24}" for v in theirs))
    print("completed/failed: " + ", ".join(f"{r.name} {r.completed}/{r.failed}" for r in reports))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default=None, help="a running server (default: start llmserve)")
    parser.add_argument("--model", default=None, help="to serve, or the server's first /models")
    parser.add_argument("--dtype", default="auto", help="for the server this starts")
    parser.add_argument("--quantization", default="none", help="for the server this starts")
    parser.add_argument("--kv-cache-dtype", default="auto", help="for the server this starts")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=None, help="per level, instead of the above")
    parser.add_argument("--input-len", type=int, default=128, help="words (about one token each)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-llama-cpp", action="store_true")
    parser.add_argument("--llama-cpp-python", default=None, help="interpreter with llama-cpp-python[server]")
    parser.add_argument(
        "--llama-server", type=executable, default=None, help="llama.cpp's llama-server binary"
    )
    parser.add_argument("--gguf", default=None, help="the GGUF for the peers (default: the served model's)")
    parser.add_argument(
        "--data-parallel-size", type=int, nargs="+", default=None, help="ranks of our servers, first compared"
    )
    parser.add_argument("--no-cold", action="store_true", help="skip each server's first load, unwarmed")
    add_json_arg(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    load = warn_if_busy()
    # A seed per level: a server's prompt cache must not find one level's prompts in another's.
    levels = [
        Workload(args.num_prompts or c * args.requests_per_stream, c, args.input_len, args.output_len, seed)
        for seed, c in enumerate(args.concurrency, start=args.seed)
    ]
    # The largest level again, with prompts of a seed no level has, as each started server's first load.
    largest = max(levels, key=lambda w: w.concurrency)
    cold = None if args.no_cold or args.base_url else dataclasses.replace(largest, seed=largest.seed + 1000)
    model, mine = ours(args, levels, cold)
    theirs = peers(args, model, levels, cold)
    results: dict[str, object] = {"model": model}
    if cold is not None:
        firsts = [server[0] for server in [*mine, *theirs]]
        mine, theirs = [server[1:] for server in mine], [server[1:] for server in theirs]
        print(f"\nfrom a fresh server, no warm-up request: {cold}")
        print_reports(firsts)
        results["cold"] = {"workload": asdict(cold), "reports": [asdict(r) for r in firsts]}
    rows = []
    for i, workload in enumerate(levels):
        reports = [*(server[i] for server in mine), *(peer[i] for peer in theirs)]
        print(f"\n{workload}")
        print_reports(reports)
        rows.append({"workload": asdict(workload), "reports": [asdict(r) for r in reports]})
    write_results(args.json, "benchmarks.serving", {**results, "levels": rows}, load)


if __name__ == "__main__":
    main()
