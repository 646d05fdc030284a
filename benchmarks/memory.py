"""Start-up and resident memory of one model: seconds from launching the engine to its first token, and
the engine core's resident memory after load and after a batch, against the budget the tests hold the
packaged models to (1.15 x the file + the KV pool + 400 MB). For files too large for CI: the synthetic
Mixture-of-Experts GGUFs (`python -m benchmarks.models synthetic olmoe-1b-7b`, `qwen3-30b-a3b`).

    .venv/bin/python -m benchmarks.memory --model /path/olmoe-1b-7b-q4_k_m.gguf --quantization gguf

Start-up is timed with the file in the page cache (read once before, as a second start would find it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.common.machine import warn_if_busy
from benchmarks.common.results import add_json_arg, write_results
from llmserve import LLM, SamplingParams
from llmserve.engine.input_processor import TokensPrompt

RUNTIME_ALLOWANCE = 400 << 20
FILE_FACTOR = 1.15


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", type=Path, required=True, help="a GGUF file")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes")
    parser.add_argument("--batch", type=int, default=16, help="prompts in the batch after load")
    add_json_arg(parser)
    args = parser.parse_args()
    load = warn_if_busy()
    warm_page_cache(args.model)
    start = time.perf_counter()
    llm = LLM(model=str(args.model), quantization=args.quantization, kv_cache_memory=args.kv_cache_memory)
    try:
        prompt: TokensPrompt = {"prompt_token_ids": list(range(100, 132))}
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        first_token_s = time.perf_counter() - start
        pid = llm.llm_engine.engine_core._core.proc.pid  # type: ignore[attr-defined]
        after_load = resident_bytes(pid)
        prompts: list[TokensPrompt] = [
            {"prompt_token_ids": list(range(100 + i, 228 + i))} for i in range(args.batch)
        ]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        after_batch = resident_bytes(pid)
    finally:
        llm.shutdown()
    size = args.model.stat().st_size
    budget = FILE_FACTOR * size + args.kv_cache_memory + RUNTIME_ALLOWANCE
    print(f"{args.model.name}: {size / 2**30:.2f} GiB file, KV pool {args.kv_cache_memory / 2**20:.0f} MiB")
    print(f"  start-up to first token (warm page cache): {first_token_s:.1f} s")
    print(
        f"  engine core resident: {after_load / 2**30:.2f} GiB after load, "
        f"{after_batch / 2**30:.2f} GiB after {args.batch} prompts; "
        f"budget {budget / 2**30:.2f} GiB ({after_batch / budget:.0%} of it)"
    )
    results = {
        "file_bytes": size,
        "kv_cache_bytes": args.kv_cache_memory,
        "first_token_s": first_token_s,
        "resident_after_load": after_load,
        "resident_after_batch": after_batch,
        "budget": budget,
    }
    write_results(args.json, "benchmarks.memory", results, load)


if __name__ == "__main__":
    main()
