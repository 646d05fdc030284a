"""Offline throughput: llmserve's `LLM.generate` vs Hugging Face `generate()` (and llama-cpp-python when
installed) on the same GGUF weights, same seeded workload, in one run. Prints output tokens/s and ratios.

    .venv/bin/python benchmarks/throughput.py --num-prompts 64 --output-len 128
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.machine import warn_if_busy


@dataclass
class Workload:
    prompts: list[list[int]]
    output_len: int

    @property
    def output_tokens(self) -> int:
        return len(self.prompts) * self.output_len


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(args.min_input, args.max_input))]
        for _ in range(args.num_prompts)
    ]
    return Workload(prompts, args.output_len)


def run_llmserve(args: argparse.Namespace, work: Workload) -> float:
    from llmserve import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(len(work.prompts), 1))
    params = SamplingParams(temperature=0.0, max_tokens=work.output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": work.prompts[0][:8]}, SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outputs) == work.output_tokens
    llm.shutdown()
    return elapsed


def run_hf(args: argparse.Namespace, work: Workload) -> float:
    """Hugging Face batched generate(), left-padded, fp32, the same number of threads."""
    from transformers import AutoModelForCausalLM

    from llmserve.model_executor.loader import resolve_model

    source = resolve_model(args.model)
    kwargs = {"gguf_file": source.path.name} if source.format == "gguf" else {}
    folder = source.path.parent if source.format == "gguf" else source.path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
    width = max(len(p) for p in work.prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in work.prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in work.prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=work.output_len,
            min_new_tokens=work.output_len,
            do_sample=False,
            pad_token_id=pad,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == work.output_len
    return elapsed


def run_llama_cpp(args: argparse.Namespace, work: Workload) -> float | None:
    """llama-cpp-python, one sequence at a time (its Python API has no batched generation)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from llmserve.model_executor.loader import resolve_model

    path = str(resolve_model(args.model).path)
    llm = Llama(model_path=path, n_ctx=1024, n_threads=torch.get_num_threads(), verbose=False)
    start = time.perf_counter()
    for prompt in work.prompts:
        llm.reset()
        for n, _ in enumerate(llm.generate(prompt, temp=0.0), start=1):
            if n == work.output_len:
                break
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input", type=int, default=32)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers", default="hf,llama-cpp", help="comma-separated: hf, llama-cpp")
    args = parser.parse_args()
    warn_if_busy()
    from llmserve.model_executor.loader import load_model_config, resolve_model

    work = make_workload(args, load_model_config(resolve_model(args.model)).vocab_size)
    print(
        f"workload: {args.num_prompts} prompts, {args.min_input}-{args.max_input} input tokens, "
        f"{args.output_len} output tokens each, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}"
    )
    runners: dict[str, Callable[[argparse.Namespace, Workload], float | None]] = {"llmserve": run_llmserve}
    peers = {"hf": run_hf, "llama-cpp": run_llama_cpp}
    runners.update({name: peers[name] for name in args.peers.split(",") if name in peers})
    rates: dict[str, float] = {}
    for name, runner in runners.items():
        elapsed = runner(args, work)
        if elapsed is None:
            print(f"{name:>10}: not installed, skipped")
            continue
        rates[name] = work.output_tokens / elapsed
        print(f"{name:>10}: {rates[name]:8.1f} output tok/s ({elapsed:.1f} s)")
    for name, rate in rates.items():
        if name != "llmserve":
            print(f"llmserve / {name}: {rates['llmserve'] / rate:.2f}x")


if __name__ == "__main__":
    main()
