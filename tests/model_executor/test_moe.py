"""Mixture-of-Experts decoders (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE) give transformers' greedy tokens and
top-5 logprobs on the same random weights, from safetensors (fp32 and bf16) and from GGUF files whose
experts are F32, Q8_0 or Q4_K blocks, each kept in that format: in batches mixing prefill chunks with
decodes, with prefix caching on and off, with our C kernels (decode steps through decoder_step.c,
experts included) and PyTorch's. `test_moe_routing.py` checks the routing's edge cases against
transformers' own block.

The quantized files' references are transformers on the dequantized values (the fixture rounds the
HF folder's experts through the same blocks), so every comparison is fp32 against fp32.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.engine.input_processor import TokensPrompt
from llmserve.model_executor.layers.linear import Linear
from llmserve.model_executor.layers.moe import SparseMoE
from llmserve.model_executor.model_runner import ModelRunner
from llmserve.model_executor.models.moe_config import MoEConfig
from llmserve.sampling_params import StructuredOutputsParams
from tests.e2e.greedy_reference import Reference, hf_greedy
from tests.engine.test_llm_batching import assert_no_leaks, core_of, count_native_steps, make_llm, runner_of
from tests.fixtures.tiny_llama import VOCAB_SIZE
from tests.fixtures.tiny_moe import MOE_FAMILIES, write_moe_gguf, write_tiny_moe
from tests.model_executor.isas import TESTED_ISAS
from tests.model_executor.test_architectures import (
    BLOCK_SIZE,
    NUM_TOKENS,
    check,
    greedy,
    record_steps,
    shared_prefix_prompts,
)

F32, BF16 = GGMLQuantizationType.F32, GGMLQuantizationType.BF16
Q8_0, Q4_K = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K
LOGPROB_TOLERANCE = 1e-3
# checkpoint → (how its experts are stored, the file, engine options beyond the defaults)
CHECKPOINTS: dict[str, tuple[GGMLQuantizationType, str, dict[str, object]]] = {
    "safetensors": (F32, "hf", {}),
    "safetensors-pytorch-no-prefix-caching": (
        F32,
        "hf",
        {"native_kernels": False, "enable_prefix_caching": False},
    ),
    "safetensors-bf16": (BF16, "hf", {}),
    "gguf-f32": (F32, "gguf", {}),
    "gguf-q8_0": (Q8_0, "gguf", {}),
    "gguf-q4_k": (Q4_K, "gguf", {}),
}
Built = dict[tuple[str, GGMLQuantizationType], Any]


def mixed_prompts(family: str) -> list[list[int]]:
    """Short ones first: they decode while the scheduler still chunks the longer ones."""
    rng = random.Random(f"moe {family}")
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (5, 17, 30, 49, 80)]


@pytest.fixture(scope="module")
def built() -> Built:
    return {}


def folder(built: Built, family: str, expert_type: GGMLQuantizationType, tmp: pytest.TempPathFactory) -> Path:
    """The tiny `family` with its experts rounded through `expert_type`; BF16: every tensor stored bf16."""
    if (family, expert_type) not in built:
        path = tmp.mktemp(f"{family}-{expert_type.name}")
        built[family, expert_type] = write_tiny_moe(
            path, family, expert_type=F32 if expert_type == BF16 else expert_type
        )
        if expert_type == BF16:
            weights = path / "model.safetensors"
            save_file({name: t.bfloat16() for name, t in load_file(weights).items()}, weights)
    return built[family, expert_type]  # type: ignore[no-any-return]


def references(
    built: Built, family: str, expert_type: GGMLQuantizationType, model_dir: Path
) -> dict[tuple[int, ...], Reference]:
    key = (f"references {family}", expert_type)
    if key not in built:
        hf: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # as our requests' ignore_eos
        prompts = mixed_prompts(family) + shared_prefix_prompts(family)
        built[key] = {tuple(p): hf_greedy(hf, p, NUM_TOKENS) for p in prompts}
    return built[key]  # type: ignore[no-any-return]


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_matches_transformers(
    family: str,
    checkpoint: str,
    built: Built,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expert_type, kind, options = CHECKPOINTS[checkpoint]
    model_dir = folder(built, family, expert_type, tmp_path_factory)
    refs = references(built, family, expert_type, model_dir)
    model = model_dir
    if kind == "gguf":
        model = write_moe_gguf(model_dir.parent / f"{family}.gguf", model_dir, family, expert_type)
    # A budget of 16 tokens a step: prompts are prefilled in chunks while earlier requests decode.
    llm = make_llm(model, dtype="float32", max_num_batched_tokens=16, block_size=BLOCK_SIZE, **options)
    try:
        if runner_of(llm).plan.stored_weights:  # the experts as the file stores them: no fp32 copy
            experts = [m for m in runner_of(llm).model.modules() if isinstance(m, SparseMoE)]
            parts = [
                p
                for moe in experts
                for linear in moe.experts.modules()
                if isinstance(linear, Linear)
                for p in linear.parts
            ]
            assert {p.qtype for p in parts if p is not None} == {int(expert_type)}
        steps, native_steps = record_steps(llm, monkeypatch), count_native_steps(monkeypatch)
        prompts: list[TokensPrompt] = [{"prompt_token_ids": p} for p in mixed_prompts(family)]
        check(llm, llm.generate(prompts, greedy(), use_tqdm=False), refs, LOGPROB_TOLERANCE)
        assert (True, True) in steps, "no step ran a decode beside a prompt's unfinished chunk"
        # with our kernels, decode-only steps run the layers, experts included, in decoder_step.c; Qwen2-MoE's
        # shared expert is not in its code, and those layers decode op by op
        fused = runner_of(llm).plan.stored_weights and family != "qwen2_moe"
        assert (native_steps[0] > 0) == fused, native_steps

        first, *rest = shared_prefix_prompts(family)
        outputs = llm.generate({"prompt_token_ids": first}, greedy(), use_tqdm=False)  # fills the cache
        outputs += llm.generate([{"prompt_token_ids": p} for p in rest], greedy(), use_tqdm=False)
        check(llm, outputs, refs, LOGPROB_TOLERANCE)
        stats = core_of(llm).scheduler.make_stats()
        caching = core_of(llm).kv_cache_manager.enable_prefix_caching
        assert (stats.prefix_cache_hits >= len(rest) * BLOCK_SIZE) == caching, stats
        assert_no_leaks(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("isa", TESTED_ISAS[1:])  # the best build runs every test above
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_every_instruction_set_build_decodes_the_experts_alike(
    isa: str,
    family: str,
    built: Built,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """decoder_step.c's experts over Q4_K blocks, in each other build this CPU runs: transformers'
    tokens and logprobs."""
    monkeypatch.setenv("LLMSERVE_CPU_ISA", isa)
    model_dir = folder(built, family, Q4_K, tmp_path_factory)
    refs = references(built, family, Q4_K, model_dir)
    prompts: list[TokensPrompt] = [{"prompt_token_ids": p} for p in mixed_prompts(family)[:3]]
    gguf = write_moe_gguf(model_dir.parent / f"{family}-{isa}.gguf", model_dir, family, Q4_K)
    native_steps = count_native_steps(monkeypatch)
    llm = make_llm(gguf, dtype="float32")
    try:
        check(llm, llm.generate(prompts, greedy(), use_tqdm=False), refs, LOGPROB_TOLERANCE)
    finally:
        llm.shutdown()
    assert native_steps[0] > 0


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])  # Qwen2-MoE's tiny shared expert:
def test_a_rows_output_does_not_depend_on_its_batch(  # 48 wide, not whole int8 blocks
    family: str, quantization: str, built: Built, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Each expert multiplies however many rows chose it and the router however many the step has: a
    row's output alone and among 300 is the same, to the last bit. With int8 activations the plan
    multiplies the same values but sums blocks as integers up to its block_rows and in fp32 beyond, so
    only the last bits may differ."""
    llm = make_llm(folder(built, family, F32, tmp_path_factory), dtype="float32", quantization=quantization)
    try:
        block = runner_of(llm).model.decoder_layers()[0].parts.mlp
        assert isinstance(block, SparseMoE)
        x = torch.randn(300, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            together = block(x)
            alone = torch.cat([block(x[i : i + 1]) for i in range(len(x))])
        if quantization == "none":
            assert torch.equal(together, alone)
        else:
            torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    finally:
        llm.shutdown()


def test_the_start_up_log_states_the_parameters_and_the_experts(
    built: Built, tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = folder(built, "qwen3_moe", F32, tmp_path_factory)
    with caplog.at_level("INFO"):
        llm = make_llm(model_dir, dtype="float32")
    try:
        runner = core_of(llm).model_runner
        assert isinstance(runner, ModelRunner) and isinstance(runner.config, MoEConfig)
        hf: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        total, active = runner.model.parameter_counts()
        assert total == sum(p.numel() for p in hf.parameters())
        c = runner.config
        expert = 3 * c.hidden_size * c.moe_intermediate_size
        sparse_layers = c.num_hidden_layers - len(c.dense_layers)
        assert total - active == sparse_layers * (c.num_experts - c.num_experts_per_tok) * expert
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Parameters:"))
        assert "8 experts 32 wide, 2 per token, in 2 of 3 layers" in line, line
    finally:
        llm.shutdown()


def test_an_inconsistent_gguf_is_refused_naming_the_tensor(
    built: Built, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Metadata claiming 7 experts over tensors of 8; and a file cut short."""
    model_dir = shutil.copytree(folder(built, "olmoe", F32, tmp_path_factory), tmp_path / "olmoe")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_experts": 7}))
    with pytest.raises(
        ValueError, match=r"tensor 'blk\.0\.ffn_gate_inp\.weight' has shape \(8, 64\), expected \(7, 64\)"
    ):
        LLM(model=str(write_moe_gguf(tmp_path / "bad.gguf", model_dir, "olmoe")), multiprocess=False)
    good = write_moe_gguf(tmp_path / "good.gguf", folder(built, "olmoe", F32, tmp_path_factory), "olmoe")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-4096])
    with pytest.raises(ValueError, match=r"tensor '.+' runs past the end of the file \(truncated\?\)"):
        LLM(model=str(cut), multiprocess=False)


# --- the engine's other features on an MoE model -------------------------------------------------------


def test_speculative_decoding_keeps_transformers_tokens(
    built: Built, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """n-gram guesses on prompts that repeat themselves: each step checks its guesses in several rows per
    sequence through the experts, and the tokens stay transformers'."""
    model_dir = folder(built, "olmoe", F32, tmp_path_factory)
    rng = random.Random("moe spec")
    motifs = [[rng.randrange(3, VOCAB_SIZE) for _ in range(7)] for _ in range(3)]
    prompts = [motif * 5 for motif in motifs]
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    refs = {tuple(p): hf_greedy(hf, p, NUM_TOKENS) for p in prompts}
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "disable_by_batch_size": 8,
    }
    llm = make_llm(model_dir, dtype="float32", speculative_config=spec)
    try:
        batch: list[TokensPrompt] = [{"prompt_token_ids": p} for p in prompts]
        check(llm, llm.generate(batch, greedy(), use_tqdm=False), refs, LOGPROB_TOLERANCE)
        stats = core_of(llm).scheduler.make_stats().spec_decoding
        assert stats is not None and stats.num_draft_tokens > 0, stats
        assert_no_leaks(llm)
    finally:
        llm.shutdown()


def test_structured_outputs_constrain_an_moe_model(
    built: Built, tmp_path_factory: pytest.TempPathFactory
) -> None:
    llm = make_llm(folder(built, "qwen3_moe", F32, tmp_path_factory), dtype="float32")
    try:
        choices = ["the answer", "another one"]
        params = SamplingParams(
            temperature=1.0, seed=5, max_tokens=16, structured_outputs=StructuredOutputsParams(choice=choices)
        )
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in mixed_prompts("qwen3_moe")], params, use_tqdm=False
        )
        assert all(out.outputs[0].text in choices for out in outputs), [o.outputs[0].text for o in outputs]
    finally:
        llm.shutdown()


def test_data_parallel_ranks_give_one_cores_outputs(
    built: Built, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir = folder(built, "mixtral", F32, tmp_path_factory)
    prompts: list[TokensPrompt] = [{"prompt_token_ids": p} for p in mixed_prompts("mixtral")]
    outputs = []
    for ranks in (1, 2):
        with LLM(
            model=str(model_dir), dtype="float32", data_parallel_size=ranks, kv_cache_memory=8 << 20
        ) as llm:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)])
    assert outputs[0] == outputs[1]
