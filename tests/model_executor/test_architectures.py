"""Qwen3, Mistral and Phi-3 (with a sliding window shorter than the prompts; and with LongRoPE and
partial rotary) give transformers' greedy tokens and logprobs on the same random weights: in a batch
that mixes prefill chunks with decodes, with prefix caching on and off, with our C kernels and PyTorch's.

The LongRoPE model's sequences stay within its original context: past it transformers re-rotates the
whole sequence with the long factors (see `layers/rotary_embedding.py`), and the long factors' table is
checked against transformers' in `test_rotary_embedding.py` instead.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from gguf import GGUFWriter
from safetensors.torch import save_file

from llmserve import LLM, RequestOutput, SamplingParams
from llmserve.contracts import ModelRunnerOutput, SchedulerOutput
from llmserve.engine.input_processor import TokensPrompt
from llmserve.model_executor.model_runner import ModelRunner
from tests.e2e.greedy_reference import Reference, assert_matches_hf, assert_top_logprobs_match, hf_greedy
from tests.engine.test_llm_batching import assert_no_leaks, core_of, count_native_steps, make_llm
from tests.fixtures.tiny_llama import VOCAB_SIZE
from tests.fixtures.tiny_models import CONFIGS, LONGROPE_ORIGINAL_CONTEXT, write_qwen3_gguf, write_tiny_model

NUM_TOKENS = 16
BLOCK_SIZE = 16
SHARED_PREFIX = 40  # tokens: two full blocks and a part of a third, so a cache hit skips whole blocks
LOGPROB_TOLERANCE = 1e-4  # fp32 both sides; what differs is only the order of the sums
Built = dict[tuple[str, str], Any]  # (what, architecture) → the fixture's value
# name → engine options beyond the defaults (C kernels, prefix caching on)
ENGINES: dict[str, dict[str, object]] = {
    "c_kernels": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "pytorch": {"native_kernels": False},
}


def longest_prompt(arch: str) -> int:
    """LongRoPE's sequences end within the original context (the last token sampled is never fed)."""
    return LONGROPE_ORIGINAL_CONTEXT + 1 - NUM_TOKENS if arch == "phi3_longrope" else 110


def mixed_prompts(arch: str) -> list[list[int]]:
    """Short ones first: they decode while the scheduler still chunks the longer ones."""
    rng = random.Random(f"mixed {arch}")
    lengths = [5, 17, 30, 49, 80, 110]  # most longer than the sliding windows
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in lengths if n <= longest_prompt(arch)]


def shared_prefix_prompts(arch: str) -> list[list[int]]:
    rng = random.Random(f"shared {arch}")
    prefix = [rng.randrange(3, VOCAB_SIZE) for _ in range(SHARED_PREFIX)]
    return [prefix + [rng.randrange(3, VOCAB_SIZE) for _ in range(tail)] for tail in (9, 3, 6, 1)]


@pytest.fixture(scope="module", params=list(CONFIGS))
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def built() -> Built:
    """What each architecture's fixtures made, kept while pytest sets them up again between engines."""
    return {}


@pytest.fixture(scope="module")
def model_dir(arch: str, built: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if ("dir", arch) not in built:
        built["dir", arch] = write_tiny_model(tmp_path_factory.mktemp(arch), arch)
    return built["dir", arch]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def references(model_dir: Path, arch: str, built: Built) -> dict[tuple[int, ...], Reference]:
    """transformers' greedy continuation of every prompt the tests send."""
    if ("references", arch) not in built:
        hf: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # as our requests' ignore_eos
        prompts = mixed_prompts(arch) + shared_prefix_prompts(arch)
        built["references", arch] = {tuple(p): hf_greedy(hf, p, NUM_TOKENS) for p in prompts}
    return built["references", arch]  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=list(ENGINES))
def llm(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[LLM]:
    # A budget of 16 tokens a step: prompts are prefilled in chunks while earlier requests decode.
    engine = make_llm(
        model_dir, dtype="float32", max_num_batched_tokens=16, block_size=BLOCK_SIZE, **ENGINES[request.param]
    )
    yield engine
    engine.shutdown()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)


def check(
    llm: LLM,
    outputs: list[RequestOutput],
    references: dict[tuple[int, ...], Reference],
    tolerance: float = LOGPROB_TOLERANCE,
) -> None:
    for out in outputs:
        ref = references[tuple(out.prompt_token_ids)]
        assert_matches_hf(llm, out, ref)
        assert_top_logprobs_match(out.outputs[0], ref, k=5, tolerance=tolerance)


def record_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """Per step: whether it decoded some request, and whether it ran part of a prompt short of its end."""
    runner = core_of(llm).model_runner
    steps: list[tuple[bool, bool]] = []
    execute = runner.execute_model

    def recorded(scheduler_output: SchedulerOutput, *args: Any) -> ModelRunnerOutput:
        batch, requests = scheduler_output.scheduled, core_of(llm).scheduler.requests
        decodes = any(s.num_computed_tokens >= requests[s.request_id].num_prompt_tokens for s in batch)
        steps.append((decodes, any(not s.samples for s in batch)))
        return execute(scheduler_output, *args)

    monkeypatch.setattr(runner, "execute_model", recorded)
    return steps


def test_a_batch_mixing_prefill_chunks_and_decodes_matches_transformers(
    llm: LLM, arch: str, references: dict[tuple[int, ...], Reference], monkeypatch: pytest.MonkeyPatch
) -> None:
    steps, native_steps = record_steps(llm, monkeypatch), count_native_steps(monkeypatch)
    prompts = mixed_prompts(arch)
    check(llm, llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False), references)
    assert (True, True) in steps, "no step ran a decode beside a prompt's unfinished chunk"
    # with our kernels, decode-only steps run every layer in one C call (partial rotary: op by op)
    fused = core_of(llm).model_runner.plan.stored_weights and arch != "phi3_longrope"
    assert (native_steps[0] > 0) == fused, native_steps
    # prompts longer than a window: the blocks every layer has left behind went back to the pool
    released = core_of(llm).kv_cache_manager.num_window_released
    assert (released > 0) == (core_of(llm).model_runner.config.cache_window is not None), released
    assert_no_leaks(llm)


def test_prompts_sharing_a_prefix_match_transformers(
    llm: LLM, references: dict[tuple[int, ...], Reference], arch: str
) -> None:
    first, *rest = shared_prefix_prompts(arch)
    outputs = llm.generate({"prompt_token_ids": first}, greedy(), use_tqdm=False)  # fills the cache
    outputs += llm.generate([{"prompt_token_ids": p} for p in rest], greedy(), use_tqdm=False)
    check(llm, outputs, references)
    stats = core_of(llm).scheduler.make_stats()
    caching = core_of(llm).kv_cache_manager.enable_prefix_caching
    assert (stats.prefix_cache_hits >= len(rest) * BLOCK_SIZE) == caching, stats
    assert_no_leaks(llm)


def test_a_layer_decoder_step_cannot_run_decodes_op_by_op(tmp_path: Path) -> None:
    """decoder_step.c rotates whole heads; Phi-4-mini rotates 3/4 of each. The built model's check finds
    the misfit: the plan says why and decodes run op by op, instead of the load failing."""
    llm = make_llm(write_tiny_model(tmp_path, "phi3_longrope"), dtype="float32")
    try:
        runner = core_of(llm).model_runner
        assert isinstance(runner, ModelRunner) and runner.native_decoder is None
        assert runner.plan.stored_weights and not runner.plan.fused_decode
        assert any("rotates part of each" in reason for reason in runner.plan.reasons), runner.plan.reasons
        output = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, greedy(), use_tqdm=False)[0]
        assert len(output.outputs[0].token_ids) == NUM_TOKENS
    finally:
        llm.shutdown()


def test_phi3_gguf_files_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "phi3.gguf"
    writer = GGUFWriter(path, "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="Phi-3 GGUF files are not supported"):
        LLM(model=str(path), multiprocess=False)


def test_qwen3_as_gguf_gives_the_same_outputs(tmp_path: Path) -> None:
    """llama.cpp's names for the q/k norms, and head_dim from the key length (not hidden / heads)."""
    folder = write_tiny_model(tmp_path / "hf", "qwen3")
    prompts: list[TokensPrompt] = [{"prompt_token_ids": p} for p in mixed_prompts("qwen3")[:3]]
    outputs = []
    for model in (folder, write_qwen3_gguf(tmp_path / "qwen3.gguf", folder)):
        llm = make_llm(model, dtype="float32")
        try:
            outputs.append(llm.generate(prompts, greedy(), use_tqdm=False))
        finally:
            llm.shutdown()
    for a, b in zip(*outputs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_gpt_oss_is_refused_saying_what_it_lacks(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}')
    save_file({"lm_head.weight": torch.zeros(1, 1)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="GptOssForCausalLM.*MXFP4 experts, attention sinks"):
        LLM(model=str(tmp_path), multiprocess=False)
