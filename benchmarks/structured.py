"""Structured outputs benchmark: 32 concurrent `json_schema` streams against 32 free ones, on one server
in one run, and the grammar backend's own costs (compile time, mask time per step).

    .venv/bin/python -m benchmarks.structured                    # starts `llmserve serve` itself
    .venv/bin/python -m benchmarks.structured --base-url http://127.0.0.1:8000/v1 --concurrency 32

Each phase sends --concurrency streams at once, --requests-per-stream requests each, every one with
the same prompt lengths and --output-len tokens; the phases alternate (free, json_schema, free, ...)
for --rounds rounds, so that drift in the machine's load hits both. Each `json_schema` request has its
own schema (so its own compile): an array of records whose `minItems` no output of --output-len tokens
reaches, so the grammar never lets it end early and both phases generate the same number of tokens at
the same batch size; the ratio of their output tokens/s is the cost of the masks (target: >= 0.8).

The backend's costs are measured in this process on the same schemas and the served model's
tokenizer, through the engine's own `StructuredOutputBackend` (as the engine core's compile pool and
step loop call it): compile p50/p99 (`grammars.to_grammar` then `compile`), and the time to fill one
step's bitmask for --concurrency grammars, each advanced by a token its mask allows.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import numpy as np
import torch

from benchmarks.common.machine import warn_if_busy
from benchmarks.common.results import add_json_arg, write_results
from benchmarks.common.servers import free_port, llmserve_command, running
from benchmarks.serving import WORDS, Report, RequestResult, discover_model, print_reports, stream_one
from llmserve.model_executor.loader import load_tokenizer, resolve_model
from llmserve.model_executor.loader.tokenizer import eos_token_ids
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured_output.backend import Grammar
from llmserve.structured_output.grammars import to_grammar
from llmserve.structured_output.llguidance_backend import LLGuidanceBackend

DEFAULT_MODEL = "smollm2-135m-instruct"
# A record's field types: bounded, as a schema built for a small model would be.
FIELD_TYPES: list[dict[str, Any]] = [
    {"type": "string", "maxLength": 16},
    {"type": "integer", "minimum": 0, "maximum": 9999},
    {"type": "number", "minimum": -1, "maximum": 1},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue"]},
    {"type": "string", "format": "date"},
]


def record_schema(rng: random.Random) -> dict[str, Any]:
    """An array of 2-5-field records (names and types drawn from `rng`), too long for any output of
    the benchmark's length to finish."""
    names = rng.sample(WORDS, rng.randint(2, 5))
    record = {
        "type": "object",
        "properties": {name: rng.choice(FIELD_TYPES) for name in names},
        "required": names,
        "additionalProperties": False,
    }
    return {"type": "array", "items": record, "minItems": 10_000}


@dataclass(frozen=True)
class Phase:
    name: str  # "free" or "json_schema"
    prompts: list[str]
    extras: list[dict[str, Any]]  # per request: the body's constraint (empty when free)


def phases(args: argparse.Namespace, schemas: list[dict[str, Any]]) -> list[Phase]:
    rng = random.Random(args.seed)
    count = args.concurrency * args.requests_per_stream
    out = []
    for round_ in range(args.rounds):
        for name in ("free", "json_schema"):
            prompts = [" ".join(rng.choice(WORDS) for _ in range(args.input_len)) for _ in range(count)]
            extras: list[dict[str, Any]] = [{} for _ in prompts]
            if name == "json_schema":
                mine = schemas[round_ * count : (round_ + 1) * count]
                extras = [{"response_format": json_schema_format(s)} for s in mine]
            out.append(Phase(name, prompts, extras))
    return out


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "records", "schema": schema}}


async def run_phase(base_url: str, model: str, phase: Phase, concurrency: int, output_len: int) -> Report:
    limit = asyncio.Semaphore(concurrency)
    connections = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=connections) as http:

        async def limited(prompt: str, extra: dict[str, Any]) -> RequestResult:
            async with limit:
                return await stream_one(http, base_url, model, prompt, output_len, extra)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p, e) for p, e in zip(phase.prompts, phase.extras)))
        duration = time.perf_counter() - start
    for error in {r.error for r in results if r.error}:
        print(f"[{phase.name}] request failed: {error}", file=sys.stderr)
    return Report.of(phase.name, list(results), duration)


def serve_phases(args: argparse.Namespace, all_phases: list[Phase]) -> tuple[str, list[Report]]:
    """Every phase against --base-url, or against a server started (and stopped) here."""

    async def run_all(url: str, model: str) -> list[Report]:
        async with httpx.AsyncClient(timeout=600) as http:
            await stream_one(http, url, model, "Warm up.", 2)
        return [await run_phase(url, model, p, args.concurrency, args.output_len) for p in all_phases]

    if args.base_url:
        url = args.base_url.rstrip("/")
        model = args.model or discover_model(url)
        return model, asyncio.run(run_all(url, model))
    port, model = free_port(), args.model or DEFAULT_MODEL
    with running("llmserve", llmserve_command(model, port, args.dtype), port) as url:
        return model, asyncio.run(run_all(url, discover_model(url)))


def merged(name: str, reports: list[Report]) -> Report:
    """One phase kind's rounds as one report: totals added, latencies averaged over the rounds."""
    rows = [asdict(r) for r in reports if r.name == name]
    mean: dict[str, Any] = {
        k: float(np.mean([row[k] for row in rows]))
        for k in rows[0]
        if k not in ("name", "completed", "failed", "memory_gib")  # no memory read here
    }
    return Report(
        name=name, completed=sum(r["completed"] for r in rows), failed=sum(r["failed"] for r in rows), **mean
    )


@dataclass(frozen=True)
class BackendCosts:
    compile_ms_p50: float
    compile_ms_p99: float
    mask_ms_per_step_p50: float  # filling one step's bitmask for all the rows
    mask_ms_per_step_p99: float
    mask_us_per_row_p50: float
    rows: int


def backend_costs(
    model: str, schemas: list[dict[str, Any]], rows: int, steps: int, seed: int
) -> BackendCosts:
    """The engine's backend on the served model's tokenizer: each schema compiled, then `rows` of the
    grammars stepped together `steps` times, each advanced by a random token its mask allows."""
    source = resolve_model(model)
    tokenizer = load_tokenizer(source)
    backend = LLGuidanceBackend(tokenizer, len(tokenizer), eos_token_ids(source, tokenizer))
    compile_s: list[float] = []
    grammars: list[Grammar] = []
    for schema in schemas:
        start = time.perf_counter()
        grammars.append(backend.compile(to_grammar(StructuredOutputsParams(json=schema))))
        compile_s.append(time.perf_counter() - start)
    active: list[Grammar] = grammars[:rows]
    bitmask = backend.allocate_bitmask(len(active))
    rng, fill_s = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        start = time.perf_counter()
        backend.fill_bitmask(active, bitmask, list(range(len(active))))
        fill_s.append(time.perf_counter() - start)
        for row, grammar in enumerate(active):
            allowed = allowed_tokens(bitmask[row], len(tokenizer))
            token = int(allowed[torch.randint(len(allowed), (1,), generator=rng)])
            if not grammar.accept_tokens([token]):
                raise RuntimeError(f"the grammar refused token {token} its mask allowed: {grammar.error}")
    ms = np.array(compile_s) * 1e3
    per_step = np.array(fill_s) * 1e3
    return BackendCosts(
        compile_ms_p50=float(np.percentile(ms, 50)),
        compile_ms_p99=float(np.percentile(ms, 99)),
        mask_ms_per_step_p50=float(np.percentile(per_step, 50)),
        mask_ms_per_step_p99=float(np.percentile(per_step, 99)),
        mask_us_per_row_p50=float(np.percentile(per_step, 50)) * 1e3 / len(active),
        rows=len(active),
    )


def allowed_tokens(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The token ids whose bit is set in one bitmask row (int32 words, bit t % 32 of word t // 32)."""
    bits = (row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
    return bits.flatten()[:vocab_size].nonzero().flatten()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default=None, help="a running server (default: start llmserve)")
    parser.add_argument("--model", default=None, help="to serve, or the server's first /models")
    parser.add_argument("--dtype", default="auto", help="for the server this starts")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="free + json_schema phase pairs")
    parser.add_argument("--input-len", type=int, default=64, help="words (about one token each)")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    add_json_arg(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    load = warn_if_busy()
    rng = random.Random(args.seed)
    schemas = [record_schema(rng) for _ in range(args.rounds * args.concurrency * args.requests_per_stream)]
    model, reports = serve_phases(args, phases(args, schemas))
    free, constrained = merged("free", reports), merged("json_schema", reports)
    print(f"\n{args.concurrency} concurrent streams, {args.output_len} tokens each, {args.rounds} round(s)")
    print_reports([constrained, free])
    ratio = constrained.output_tokens_per_s / free.output_tokens_per_s
    print(f"json_schema/free output tokens/s: {ratio:.2f}x (target >= 0.8x)")
    costs = backend_costs(model, schemas, args.concurrency, args.output_len, args.seed)
    print(
        f"grammar compile: p50 {costs.compile_ms_p50:.2f} ms, p99 {costs.compile_ms_p99:.2f} ms "
        f"({len(schemas)} schemas); mask per step ({costs.rows} rows): "
        f"p50 {costs.mask_ms_per_step_p50:.2f} ms, p99 {costs.mask_ms_per_step_p99:.2f} ms "
        f"({costs.mask_us_per_row_p50:.0f} us per row)"
    )
    results = {
        "model": model,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "reports": [asdict(r) for r in reports],
        "output_tokens_per_s_ratio": ratio,
        "backend": asdict(costs),
    }
    write_results(args.json, "benchmarks.structured", results, load)


if __name__ == "__main__":
    main()
