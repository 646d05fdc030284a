"""The scheduler and the model runner talk in data: every step's `SchedulerOutput` and `ModelRunnerOutput`
survives msgpack, so the runner could live in another process. An engine whose steps cross through
msgpack both ways gives the outputs of one whose steps do not, with seeds, logprobs, prompt logprobs,
penalties, chunked prefills and preemptions in the mix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from llmserve import LLM, SamplingParams
from llmserve.contracts import ModelRunnerOutput, SchedulerOutput
from tests.engine.test_llm_batching import assert_no_leaks, core_of, make_llm, random_prompts, runner_of


def through_msgpack(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make every step's scheduler output and runner output an encoded and decoded copy; returns a
    one-item list counting the steps."""
    runner, steps = runner_of(llm), [0]
    execute = runner.execute_model

    def crossing(scheduler_output: SchedulerOutput, *args: Any) -> ModelRunnerOutput:
        steps[0] += 1
        sent = msgspec.msgpack.decode(msgspec.msgpack.encode(scheduler_output), type=SchedulerOutput)
        assert sent == scheduler_output
        answer = execute(sent, *args)
        return msgspec.msgpack.decode(msgspec.msgpack.encode(answer), type=ModelRunnerOutput)

    monkeypatch.setattr(runner, "execute_model", crossing)
    return steps


def test_steps_through_msgpack_give_the_same_outputs(
    tiny_llama_hf_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = random_prompts(16, 150, 250, seed=5)
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1),
        SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=0.5, min_tokens=4),
    ]
    batch = [params[i % len(params)] for i in range(len(prompts))]
    results = []
    for crossing in (False, True):
        # a small pool and token budget: chunked prefills and preemptions (requests resent whole)
        llm = make_llm(
            tiny_llama_hf_dir, kv_cache_memory=64 * 8192, max_model_len=512, max_num_batched_tokens=64
        )
        try:
            steps = through_msgpack(llm, monkeypatch) if crossing else [1]
            results.append(llm.generate(prompts, batch, use_tqdm=False))
            assert steps[0] > 0 and core_of(llm).scheduler.num_preemptions > 0
            assert_no_leaks(llm)
        finally:
            llm.shutdown()
    plain, crossed = results
    for a, b in zip(plain, crossed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
        assert a.prompt_logprobs == b.prompt_logprobs
