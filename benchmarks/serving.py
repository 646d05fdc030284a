"""Serving benchmark: a fixed, seeded streaming load against any OpenAI-compatible server.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --num-prompts 16 --concurrency 8 \\
        --input-len 64 --output-len 32 [--compare-llama-cpp [--gguf FILE]]

Prints time to first token (p50, p99), inter-token latency (p50 of the gaps between streamed chunks),
output tokens/s and requests/s over the whole run. With `--compare-llama-cpp` it also starts
llama-cpp-python's server (`python -m llama_cpp.server`) on the same GGUF, runs the same workload on
it, and prints both and the ratio. Prompts are random common words, about one token each.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

# fmt: off
WORDS = [
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye",
    "woman", "place", "work", "week", "case", "point", "company", "number", "group", "problem", "fact",
    "house", "river", "music", "story", "water", "light", "city", "road", "tree", "paper", "table",
]
# fmt: on
STARTUP_TIMEOUT_S = 300.0


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
        }


async def stream_one(
    http: httpx.AsyncClient, base_url: str, model: str, prompt: str, n: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,  # a vLLM extension; servers without it may stop early (counted as they stop)
        "stream": True,
        "stream_options": {"include_usage": True},
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


async def run_workload(name: str, base_url: str, model: str, workload: Workload) -> Report:
    limit = asyncio.Semaphore(workload.concurrency)
    connections = httpx.Limits(max_connections=workload.concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=connections) as http:

        async def limited(prompt: str) -> RequestResult:
            async with limit:
                return await stream_one(http, base_url, model, prompt, workload.output_len)

        await stream_one(http, base_url, model, "Warm up.", 2)
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in workload.prompts()))
        duration = time.perf_counter() - start
    for error in {r.error for r in results if r.error}:
        print(f"[{name}] request failed: {error}", file=sys.stderr)
    return Report.of(name, list(results), duration)


def discover_model(base_url: str) -> str:
    return str(httpx.get(f"{base_url}/models", timeout=30).json()["data"][0]["id"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_llama_cpp(gguf: Path, port: int, context: int) -> subprocess.Popen[bytes]:
    """llama-cpp-python's OpenAI server on `gguf`, once it answers /v1/models."""
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(context)]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"llama_cpp.server did not start (exit code {proc.poll()}).")


def gguf_of(model: str, explicit: str | None) -> Path:
    if explicit is not None:
        return Path(explicit)
    from llmserve.model_executor.loader import resolve_model

    source = resolve_model(model)
    if source.format != "gguf":
        raise SystemExit(f"{model} is not a GGUF model: pass --gguf FILE for llama.cpp.")
    return source.path


def print_reports(reports: list[Report]) -> None:
    names = [r.name for r in reports]
    header = (
        f"{'':18}"
        + "".join(f"{n:>14}" for n in names)
        + ("   ratio (first/second)" if len(reports) == 2 else "")
    )
    print(header)
    for key in reports[0].rows():
        values = [r.rows()[key] for r in reports]
        line = f"{key:18}" + "".join(f"{v:14.2f}" for v in values)
        if len(values) == 2 and values[1]:
            line += f"   {values[0] / values[1]:.2f}x"
        print(line)
    print("completed/failed: " + ", ".join(f"{r.name} {r.completed}/{r.failed}" for r in reports))


def compare_llama_cpp(args: argparse.Namespace, model: str, workload: Workload) -> Report | None:
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed (pip install 'llama-cpp-python[server]'): no comparison.")
        return None
    gguf = gguf_of(model, args.gguf)
    port = free_port()
    proc = start_llama_cpp(gguf, port, args.input_len + args.output_len + 64)
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        return asyncio.run(run_workload("llama.cpp", base_url, discover_model(base_url), workload))
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="(default: the first of the server's /models)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-llama-cpp", action="store_true")
    parser.add_argument("--gguf", default=None, help="the GGUF for llama.cpp (default: the served model's)")
    args = parser.parse_args()
    workload = Workload(args.num_prompts, args.concurrency, args.input_len, args.output_len, args.seed)
    base_url = args.base_url.rstrip("/")
    model = args.model or discover_model(base_url)
    reports = [asyncio.run(run_workload("server", base_url, model, workload))]
    if args.compare_llama_cpp:
        theirs = compare_llama_cpp(args, model, workload)
        reports += [theirs] if theirs is not None else []
    print(f"{model}: {workload}")
    print_reports(reports)


if __name__ == "__main__":
    main()
