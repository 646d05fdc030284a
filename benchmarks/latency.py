"""Latency: streaming TTFT / time per output token through `AsyncLLM` at several concurrencies, the cost
of the process hop (core in its own process vs in-process), and single-stream decode speed with the
memory bandwidth it achieves against this machine's measured peak; `--only prefill` (not part of the
default run) times one prompt at each --prefill-lens to its first token.

    .venv/bin/python -m benchmarks.latency                 # everything
    .venv/bin/python -m benchmarks.latency --only decode   # one section: async, hop, decode or prefill
    .venv/bin/python -m benchmarks.latency --only decode --dtypes float32 --quantizations none fp16

Decode runs once per --dtypes x --quantizations pair the engine accepts; with --llama-batched-bench BIN,
llama.cpp decodes the same lengths on the same GGUF, one sequence, and its rate (S_TG) and our ratio
to it are printed beside ours. A GGUF's Q4_1/Q8_0 blocks are
read directly at one sequence when the engine can, so the bytes per token (and the formats) are counted
from the kernels the engine chose; another GGUF quantization is measured by passing its file as --model.
With --llama-batched-bench the prefill section runs llama.cpp's one-sequence S_PP at the same lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
from typing import Any

import torch

from benchmarks.common.machine import warn_if_busy
from benchmarks.common.peers import executable, gguf_of, run_batched_bench
from benchmarks.common.results import add_json_arg, write_results
from llmserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from llmserve.engine.input_processor import TokensPrompt


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream_once(engine: AsyncLLM, prompt: list[int], output_len: int, rid: str) -> tuple[float, float]:
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    start = time.perf_counter()
    first = last = 0.0
    async for _ in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, rid):
        last = time.perf_counter()
        if not first:
            first = last
    return first - start, (last - first) / max(output_len - 1, 1)


async def async_section(args: argparse.Namespace) -> dict[str, object]:
    engine = AsyncLLM(model=args.model, log_stats=False)
    rng = random.Random(0)
    await stream_once(engine, [rng.randrange(100, 40000) for _ in range(8)], 4, "warmup")
    print(f"AsyncLLM streaming (input {args.input_len}, output {args.output_len} tokens)")
    levels: dict[str, object] = {}
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
        levels[str(concurrency)] = {
            "ttft_p50_ms": percentile(ttft, 0.5),
            "ttft_p99_ms": percentile(ttft, 0.99),
            "tpot_p50_ms": percentile(tpot, 0.5),
            "tpot_p99_ms": percentile(tpot, 0.99),
        }
    engine.shutdown()
    return {"input_len": args.input_len, "output_len": args.output_len, "concurrency": levels}


def hop_section(args: argparse.Namespace) -> dict[str, float]:
    """Same decode-heavy batch of 8 through LLM with the core in-process and in its own process."""
    rng = random.Random(1)
    prompts = [
        TokensPrompt(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(16)]) for _ in range(8)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    times: dict[bool, float] = {}
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
    return {"inprocess_ms_per_step": times[False] * 1e3, "zmq_ms_per_step": times[True] * 1e3}


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


def decode_weight_bytes(model: Any) -> tuple[int, str]:
    """Weight bytes one single-sequence decode step reads (every projection and the output head; norms,
    routers and the one embedding row are noise; of a Mixture-of-Experts layer's experts, the k a token
    takes: k / E of their bytes), and the formats it reads them in: the stored weights of
    `llmserve/model_executor/layers/linear.py`'s kernels, else the weight at the model's dtype."""
    from llmserve.model_executor.layers.linear import Linear, StoredKernel
    from llmserve.model_executor.layers.moe import SparseMoE

    formats = set[str]()

    def size(kernel: Any, weight: Any) -> int:
        if isinstance(kernel, StoredKernel):
            formats.update(kernel_format(qtype) for qtype in kernel.weight.qtypes)
            return int(kernel.weight.nbytes)
        if weight is None:
            return 0
        formats.add(str(weight.dtype).removeprefix("torch."))
        return int(weight.numel() * weight.element_size())

    heads = [(m.kernel, m.weight) for m in model.modules() if isinstance(m, Linear)]
    if model.lm_head is None:
        heads.append((model.logits_kernel, getattr(model.embed_tokens, "weight", None)))
    total = sum(size(kernel, weight) for kernel, weight in heads)
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        experts = sum(size(m.kernel, m.weight) for m in moe.experts.modules() if isinstance(m, Linear))
        total -= experts * (len(moe.experts) - moe.gate.top_k) // len(moe.experts)
    return total, "+".join(sorted(formats))


def kernel_format(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(qtype).name


def decode_rate(llm: LLM, args: argparse.Namespace) -> float:
    """Tokens/s between the first and the last token (the prefill excluded), median of three runs."""
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=list(range(100, 100 + args.input_len)))
    llm.generate(prompt, SamplingParams(max_tokens=4), use_tqdm=False)
    rates = []
    for _ in range(3):
        m = llm.generate(prompt, params, use_tqdm=False)[0].metrics
        assert m is not None and m.first_token_time is not None and m.last_token_time is not None
        rates.append((args.output_len - 1) / (m.last_token_time - m.first_token_time))
    return statistics.median(rates)


def decode_section(args: argparse.Namespace) -> dict[str, object]:
    peak = measured_bandwidth()
    print(f"single-stream decode (machine read bandwidth {peak:.1f} GB/s, {torch.get_num_threads()} threads)")
    variants: dict[str, object] = {}
    for dtype, quantization in itertools.product(args.dtypes, args.quantizations):
        name = dtype if quantization == "none" else f"{dtype}, {quantization}"
        try:
            llm = LLM(
                model=args.model,
                dtype=dtype,
                quantization=quantization,
                native_kernels=args.native_kernels,
                multiprocess=False,
            )
        except ValueError as e:
            print(f"  {name:>16}: skipped: {e}")
            continue
        runner = llm.llm_engine.engine_core.engine_core.model_runner  # type: ignore[attr-defined]
        weight_bytes, formats = decode_weight_bytes(runner.model)
        tok_s = decode_rate(llm, args)
        llm.shutdown()
        achieved = weight_bytes * tok_s / 1e9
        roofline = peak * 1e9 / weight_bytes
        print(
            f"  {name:>16}: {tok_s:6.1f} tok/s; reads {weight_bytes / 1e6:.0f} MB ({formats}) → "
            f"{achieved:.1f} GB/s, {achieved / peak * 100:.0f}% of peak (roofline {roofline:.0f} tok/s)"
        )
        variants[name] = {
            "tok_per_s": tok_s,
            "weight_mb": weight_bytes / 1e6,
            "formats": formats,
            "achieved_gb_s": achieved,
            "fraction_of_peak": achieved / peak,
        }
    results: dict[str, object] = {"model": args.model, "peak_gb_s": peak, "dtypes": variants}
    if args.llama_batched_bench:
        results["llama_batched_bench_tok_per_s"] = llama_cpp_decode(args, variants)
    return results


def llama_cpp_decode(args: argparse.Namespace, variants: dict[str, Any]) -> float | str:
    """llama.cpp's single-sequence decode rate on the same GGUF and lengths, and our ratios to it."""
    gguf = gguf_of(args.model)
    rows = (
        run_batched_bench(args.llama_batched_bench, gguf, [1], args.input_len, args.output_len)
        if gguf
        else "no GGUF for this model"
    )
    if isinstance(rows, str):
        print(f"  llama-batched-bench: {rows}")
        return rows
    theirs = rows[0].gen_tok_per_s
    ratios = ", ".join(f"{name} {v['tok_per_s'] / theirs:.2f}x" for name, v in variants.items())
    print(f"  llama.cpp (llama-batched-bench, 1 sequence): {theirs:6.1f} tok/s; ours/theirs: {ratios}")
    return theirs


def prefill_rate(llm: LLM, length: int) -> float:
    """Prompt tokens/s of one prompt of `length` tokens to its first token, median of three runs; each
    run's prompt is new, so no prefix is cached."""
    rng = random.Random(length)
    llm.generate(TokensPrompt(prompt_token_ids=[100] * 8), SamplingParams(max_tokens=1), use_tqdm=False)
    rates = []
    for _ in range(3):
        prompt = TokensPrompt(prompt_token_ids=[rng.randrange(100, 20000) for _ in range(length)])
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        rates.append(length / (time.perf_counter() - start))
    return statistics.median(rates)


def prefill_section(args: argparse.Namespace) -> dict[str, object]:
    """One prompt at each --prefill-lens, per dtype x quantization; with --llama-batched-bench, llama.cpp's
    S_PP for one sequence of the same lengths on the same GGUF, in the same run."""
    print(f"single-prompt prefill, {args.prefill_lens} tokens")
    variants: dict[str, dict[str, float]] = {}
    for dtype, quantization in itertools.product(args.dtypes, args.quantizations):
        name = dtype if quantization == "none" else f"{dtype}, {quantization}"
        try:
            llm = LLM(model=args.model, dtype=dtype, quantization=quantization, multiprocess=False)
        except ValueError as e:
            print(f"  {name:>16}: skipped: {e}")
            continue
        variants[name] = {str(n): prefill_rate(llm, n) for n in args.prefill_lens}
        llm.shutdown()
        print(f"  {name:>16}: " + ", ".join(f"{n}: {r:.1f} tok/s" for n, r in variants[name].items()))
    results: dict[str, object] = {"model": args.model, "lengths": args.prefill_lens, "dtypes": variants}
    gguf = gguf_of(args.model)
    if args.llama_batched_bench and gguf:
        theirs: dict[str, float | str] = {}
        for n in args.prefill_lens:
            rows = run_batched_bench(args.llama_batched_bench, gguf, [1], n, 1)
            theirs[str(n)] = rows if isinstance(rows, str) else rows[0].prompt_tok_per_s
        print(
            "  llama.cpp (llama-batched-bench S_PP, 1 sequence): "
            + ", ".join(f"{n}: {r}" for n, r in theirs.items())
        )
        results["llama_batched_bench_tok_per_s"] = theirs
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--quantizations", nargs="+", default=["none", "fp16"], help="engine quantization")
    parser.add_argument(
        "--native-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-native-kernels: PyTorch ops only (no GGUF blocks read directly)",
    )
    parser.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 512], help="prompt tokens")
    parser.add_argument("--only", choices=["async", "hop", "decode", "prefill"])
    parser.add_argument("--llama-batched-bench", type=executable, default=None, help="llama.cpp's binary")
    add_json_arg(parser)
    args = parser.parse_args()
    load = warn_if_busy()
    results: dict[str, object] = {"model": args.model}
    if args.only in (None, "async"):
        results["async"] = asyncio.run(async_section(args))
    if args.only in (None, "hop"):
        results["hop"] = hop_section(args)
    if args.only in (None, "decode"):
        results["decode"] = decode_section(args)
    if args.only == "prefill":
        results["prefill"] = prefill_section(args)
    write_results(args.json, "benchmarks.latency", results, load)


if __name__ == "__main__":
    main()
