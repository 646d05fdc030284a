"""The peer runner's contract (one JSON job in, elapsed seconds and the token count out), against fake
llama_cpp and vllm modules: the real ones live in their own virtual environments."""

from __future__ import annotations

import itertools
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.common import peer_runner

JOB = {"model": "m.gguf", "prompts": [[5, 6, 7], [8, 9]], "output_len": 4, "threads": 2, "dtype": "float32"}


class FakeLlama:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs

    def reset(self) -> None:
        pass

    def generate(self, tokens: list[int], temp: float) -> Iterator[int]:
        return itertools.count()  # like llama-cpp-python: never stops by itself


class FakeVLLM:
    def __init__(self, **kwargs: Any) -> None:
        assert kwargs["skip_tokenizer_init"] and kwargs["max_num_seqs"] == 2

    def generate(self, prompts: list[dict[str, list[int]]], params: Any, use_tqdm: bool) -> list[Any]:
        output = types.SimpleNamespace(token_ids=list(range(params.kwargs["max_tokens"])))
        return [types.SimpleNamespace(outputs=[output]) for _ in prompts]


def test_llama_cpp_generates_output_len_per_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    result = peer_runner.run_llama_cpp({"peer": "llama-cpp", **JOB})
    assert result["output_tokens"] == 8 and result["elapsed"] >= 0


def test_vllm_counts_the_tokens_it_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    params = type("SamplingParams", (), {"__init__": lambda self, **kw: setattr(self, "kwargs", kw)})
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeVLLM, SamplingParams=params))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the runner sets these only when unset
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    result = peer_runner.run_vllm({"peer": "vllm", **JOB})
    assert result["output_tokens"] == 8


def test_a_failing_peer_process_raises_with_its_output() -> None:
    from benchmarks.common.peers import run_peer

    with pytest.raises(RuntimeError, match="llama-cpp runner failed"):
        run_peer(sys.executable, {"peer": "llama-cpp", **JOB, "model": "/nonexistent.gguf"})


def test_a_cold_job_runs_no_warm_up_and_times_from_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "cold" carries the launch's time.time(): the result adds the constructor's seconds and the
    seconds from the launch to the last token, and the batch is the first thing generated; "then"
    prompts come next, timed apart."""
    calls: list[int] = []

    class Counting(FakeVLLM):
        def generate(self, prompts: list[dict[str, list[int]]], params: Any, use_tqdm: bool) -> list[Any]:
            calls.append(len(prompts))
            return super().generate(prompts, params, use_tqdm)

    params = type("SamplingParams", (), {"__init__": lambda self, **kw: setattr(self, "kwargs", kw)})
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=Counting, SamplingParams=params))
    launched = time.time() - 5.0
    result = peer_runner.run_vllm({"peer": "vllm", **JOB, "cold": launched})
    assert calls == [2] and result["output_tokens"] == 8
    assert result["since_launch"] >= 5.0 and result["startup"] >= 0 and "then_elapsed" not in result
    calls.clear()
    result = peer_runner.run_vllm({"peer": "vllm", **JOB, "cold": launched, "then": [[7, 8, 9]] * 3})
    assert calls == [2, 3] and result["output_tokens"] == 8 and result["then_elapsed"] >= 0
    calls.clear()
    warm = peer_runner.run_vllm({"peer": "vllm", **JOB})
    assert calls == [1, 2] and "since_launch" not in warm


def test_the_next_cold_batch_is_the_same_work_in_new_prompts() -> None:
    from benchmarks.throughput import Workload, moved_by_one

    work = Workload([[100, 5000, 49151], [49150]], 8)
    moved = moved_by_one(work, 49152)
    assert moved.prompts == [[101, 5001, 100], [49151]] and moved.output_len == 8
