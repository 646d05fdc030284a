"""Runs one peer engine on a workload of token ids and prints how long it took. It is started with the
peer's own interpreter (llama-cpp-python and vLLM live in their own virtual environments), so it
imports nothing but the standard library and the peer.

    echo '{"peer": "llama-cpp", "model": "m.gguf", "prompts": [[1, 2]], "output_len": 8, "threads": 2}' \\
        | PEER_VENV/bin/python benchmarks/common/peer_runner.py

stdin: {"peer": "llama-cpp" | "vllm" | "llmserve", "model", "prompts": [[token ids]], "output_len",
"threads", "dtype"}, and for llmserve its "engine_args" (keyword arguments of its `LLM`).
stdout: a last line `PEER_RESULT {"elapsed": seconds, "output_tokens": n}` (the peers log to stdout too).
With "cold": the time.time() the process was launched, vLLM and llmserve run the batch right after
their constructor, with no warm-up request, and the result adds "startup" (the constructor's seconds)
and "since_launch" (seconds from the launch to the last token): what a user of a fresh process waits.
With "then" too (more prompts), that batch runs next in the same process and "then_elapsed" is its time.
For sentence-transformers (the embeddings benchmark): {"peer": "sentence-transformers", "model" (its
folder), "sentences": [str], "batch_size", "threads"} → `PEER_RESULT {"elapsed": seconds, "sentences": n}`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

RESULT_MARK = "PEER_RESULT "


def run_llama_cpp(job: dict[str, Any]) -> dict[str, float]:
    """One sequence at a time: llama-cpp-python's API has no batched generation. `generate()` does not
    stop at EOS by itself, so every sequence yields `output_len` tokens (what ignore_eos asks)."""
    from llama_cpp import Llama

    prompts: list[list[int]] = job["prompts"]
    context = max(len(p) for p in prompts) + job["output_len"] + 16
    threads = int(job["threads"])
    llm = Llama(
        model_path=job["model"],
        n_ctx=context,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )
    _llama_cpp_sequence(llm, prompts[0][:8], 2)  # warm up
    start = time.perf_counter()
    produced = sum(_llama_cpp_sequence(llm, prompt, job["output_len"]) for prompt in prompts)
    return {"elapsed": time.perf_counter() - start, "output_tokens": produced}


def _llama_cpp_sequence(llm: Any, prompt: list[int], output_len: int) -> int:
    llm.reset()  # no KV reuse from the previous prompt
    produced = 0
    for produced, _ in enumerate(llm.generate(prompt, temp=0.0), start=1):
        if produced == output_len:
            break
    return produced


def run_vllm(job: dict[str, Any]) -> dict[str, float]:
    """vLLM's offline `LLM.generate` on token ids (no tokenizer needed: `skip_tokenizer_init`)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB; the CPU build's KV pool
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{int(job['threads']) - 1}")  # our thread count
    from vllm import LLM, SamplingParams

    prompts: list[list[int]] = job["prompts"]
    started = time.perf_counter()
    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype=job.get("dtype", "auto"),
        seed=0,
        max_model_len=max(len(p) for p in prompts) + job["output_len"] + 16,
        max_num_seqs=len(prompts),
    )
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True, detokenize=False)
    warmup = SamplingParams(max_tokens=2, detokenize=False)
    return _batch(
        job,
        startup,
        lambda: llm.generate([{"prompt_token_ids": prompts[0][:8]}], warmup, use_tqdm=False),
        lambda batch: llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False),
    )


def run_llmserve(job: dict[str, Any]) -> dict[str, float]:
    """Our own `LLM.generate`, in a process of its own like the peers: for the cold figures."""
    from llmserve import LLM, SamplingParams
    from llmserve.engine.input_processor import TokensPrompt

    prompts: list[list[int]] = job["prompts"]
    started = time.perf_counter()
    llm = LLM(model=job["model"], seed=0, max_num_seqs=len(prompts), **job.get("engine_args", {}))
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True)
    warmup = SamplingParams(max_tokens=2)
    try:
        return _batch(
            job,
            startup,
            lambda: llm.generate(TokensPrompt(prompt_token_ids=prompts[0][:8]), warmup, use_tqdm=False),
            lambda batch: llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False
            ),
        )
    finally:
        llm.shutdown()


def _batch(
    job: dict[str, Any],
    startup: float,
    warm_up: Callable[[], Any],
    generate: Callable[[list[list[int]]], list[Any]],
) -> dict[str, float]:
    """Times `generate` on the job's prompts (after `warm_up`, unless the job is cold) and counts the
    tokens it returns; then, for a cold job, on its "then" prompts."""
    if not job.get("cold"):
        warm_up()
    start = time.perf_counter()
    outputs = generate(job["prompts"])
    result = {
        "elapsed": time.perf_counter() - start,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "startup": startup,
    }
    if job.get("cold"):
        result["since_launch"] = time.time() - job["cold"]
        if job.get("then"):
            start = time.perf_counter()
            generate(job["then"])
            result["then_elapsed"] = time.perf_counter() - start
    return result


def run_sentence_transformers(job: dict[str, Any]) -> dict[str, float]:
    """sentence-transformers' `encode`, as its users call it: its own tokenizing, sorting by length,
    padding to each batch's longest, pooling and normalising, `batch_size` sentences at a time."""
    import torch

    torch.set_num_threads(int(job["threads"]))
    from sentence_transformers import SentenceTransformer

    sentences: list[str] = job["sentences"]
    batch_size = int(job["batch_size"])
    model = SentenceTransformer(job["model"], device="cpu")
    model.encode(sentences[:batch_size], batch_size=batch_size)  # warm up
    start = time.perf_counter()
    vectors = model.encode(sentences, batch_size=batch_size)
    return {"elapsed": time.perf_counter() - start, "sentences": float(len(vectors))}


RUNNERS = {
    "llama-cpp": run_llama_cpp,
    "vllm": run_vllm,
    "llmserve": run_llmserve,
    "sentence-transformers": run_sentence_transformers,
}


def main() -> None:
    job = json.load(sys.stdin)
    result = RUNNERS[job["peer"]](job)
    print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
