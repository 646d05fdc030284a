"""The fast paths change speed, never outputs: each is compared with the plain PyTorch path."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import cast

import pytest
import torch
from gguf import GGMLQuantizationType

from llmserve import LLM, RequestOutput, SamplingParams
from llmserve.engine.input_processor import TokensPrompt
from llmserve.model_executor.layers.linear import StoredKernel
from llmserve.model_executor.layers.mlp import GatedMLP
from llmserve.model_executor.models.llama import LlamaDecoderLayer
from tests.engine.test_llm_batching import make_llm, runner_of
from tests.fixtures.tiny_llama import VOCAB_SIZE, gguf_name, write_gguf
from tests.greedy_match import NEAR_TIE_NATS, assert_same_greedy


@pytest.mark.usefixtures("native_library")
@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "tolerance"),
    [("float32", "auto", 1e-4), ("bfloat16", "auto", 0.05), ("float32", "bfloat16", 1e-3)],
)
def test_native_decode_attention_gives_the_torch_outputs(
    tiny_llama_hf_dir: Path, dtype: str, kv_cache_dtype: str, tolerance: float
) -> None:
    """In bf16 the C kernels read the bf16 cache and compute in fp32 where PyTorch's products
    round to bf16 on the way: logprobs agree within bf16's rounding, and a near-tie may rank the
    runners-up apart. A bf16 cache under the fp32 model (`--kv-cache-dtype bfloat16`) holds the same
    rounded keys and values on both paths, but where their fp32 values differ by a rounding."""
    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB_SIZE) for _ in range(40)]
    prompts: list[TokensPrompt] = [
        {"prompt_token_ids": shared + [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(1, 90))]}
        for _ in range(12)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    results = {}
    cache_dtype = torch.bfloat16 if "bfloat16" in (dtype, kv_cache_dtype) else torch.float32
    for native_kernels in (True, False):
        # Small token budget: prefill chunks, prefix hits and decodes share steps.
        llm = make_llm(
            tiny_llama_hf_dir,
            native_kernels=native_kernels,
            max_num_batched_tokens=64,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
        )
        try:
            assert runner_of(llm).native == native_kernels
            assert runner_of(llm).kv_caches[0][0].dtype == cache_dtype
            results[native_kernels] = llm.generate(prompts, params, use_tqdm=False)
            if not native_kernels:
                bf16 = dtype == "bfloat16"
                assert_same_outputs(llm, results[True], results[False], tolerance, same_runners_up=not bf16)
        finally:
            llm.shutdown()


@pytest.mark.usefixtures("native_library")
def test_gguf_block_kernels_give_the_torch_outputs(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    """A GGUF whose projections are Q4_1 and output head Q8_0, decoded a few rows at a time from blocks,
    through every layer in one C call."""
    types = {gguf_name(name): GGMLQuantizationType.Q4_1 for name in _projection_names(tiny_llama_hf_dir)}
    types["output.weight"] = GGMLQuantizationType.Q8_0
    path = write_gguf(tmp_path / "q4.gguf", tiny_llama_hf_dir, types=types)
    rng = random.Random(9)
    prompts: list[TokensPrompt] = [
        {"prompt_token_ids": [rng.randrange(3, VOCAB_SIZE) for _ in range(20 + 7 * i)]} for i in range(5)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    results = {}
    for native_kernels in (True, False):
        llm = make_llm(path, native_kernels=native_kernels, max_num_seqs=4)
        try:
            model = runner_of(llm).model
            # mypy sees an nn.ModuleList's items as plain Modules; the tiny Llama's are LlamaDecoderLayers
            layers = [cast(LlamaDecoderLayer, layer) for layer in model.layers]
            kernels = [cast(GatedMLP, layer.mlp).down_proj.kernel for layer in layers] + [model.logits_kernel]
            assert all(isinstance(k, StoredKernel) for k in kernels) == native_kernels
            assert (runner_of(llm).native_decoder is not None) == native_kernels  # decodes in C
            results[native_kernels] = llm.generate(prompts, params, use_tqdm=False)
            if not native_kernels:
                assert_same_outputs(llm, results[True], results[False])
        finally:
            llm.shutdown()


def assert_same_outputs(
    plain_llm: LLM,
    fast: list[RequestOutput],
    plain: list[RequestOutput],
    tolerance: float = 1e-4,
    same_runners_up: bool = True,
) -> None:
    """Same greedy tokens (near-tie rule, a near-tie being closer than `tolerance` where that is wider)
    and logprobs within `tolerance` up to a near-tie: summation order (and in bf16, where it rounds) is
    all that differs. Without `same_runners_up` only the tokens both runs ranked are compared."""
    for a, b in zip(fast, plain, strict=True):
        tie = assert_same_greedy(plain_llm, a, b, max(tolerance, NEAR_TIE_NATS))
        compared = len(b.outputs[0].token_ids) if tie is None else tie + 1
        assert a.outputs[0].logprobs is not None and b.outputs[0].logprobs is not None
        for x, y in zip(a.outputs[0].logprobs[:compared], b.outputs[0].logprobs[:compared]):
            tokens = x.keys() if same_runners_up else x.keys() & y.keys()
            assert tokens
            for token in tokens:
                assert abs(x[token].logprob - y[token].logprob) < tolerance


def _projection_names(hf_dir: Path) -> list[str]:
    layers = json.loads((hf_dir / "config.json").read_text())["num_hidden_layers"]
    parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    parts += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    return [f"model.layers.{i}.{part}.weight" for i in range(layers) for part in parts]


@pytest.mark.usefixtures("native_library")
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_weight_only_quantization_is_the_same_at_every_batch_size(
    tiny_llama_hf_dir: Path, quantization: str
) -> None:
    llm = make_llm(tiny_llama_hf_dir, quantization=quantization)
    try:
        model = runner_of(llm).model
        # mypy sees an nn.ModuleList's items as plain Modules; the tiny Llama's are LlamaDecoderLayers
        layers = [cast(LlamaDecoderLayer, layer) for layer in model.layers]
        kernels = [layer.self_attn.qkv_proj.kernel for layer in layers]
        assert all(isinstance(k, StoredKernel) and k.plan.int8_activations for k in kernels)
        assert_same_together_and_alone(llm, seed=11)
    finally:
        llm.shutdown()


@pytest.mark.usefixtures("native_library")
def test_gguf_int8_activations_are_the_same_at_every_batch_size(
    tiny_llama_hf_dir: Path, tmp_path: Path
) -> None:
    """`--quantization gguf` keeps a GGUF's Q5_0/Q4_0/Q8_0 blocks as stored."""
    kinds = [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0]
    names = _projection_names(tiny_llama_hf_dir)
    types = {gguf_name(name): kinds[i % 3] for i, name in enumerate(names)}
    types["output.weight"] = GGMLQuantizationType.Q8_0
    llm = make_llm(write_gguf(tmp_path / "mixed.gguf", tiny_llama_hf_dir, types=types), quantization="gguf")
    try:
        model = runner_of(llm).model
        # mypy sees an nn.ModuleList's items as plain Modules; the tiny Llama's are LlamaDecoderLayers
        layers = [cast(LlamaDecoderLayer, layer) for layer in model.layers]
        kernels = [cast(GatedMLP, layer.mlp).down_proj.kernel for layer in layers] + [model.logits_kernel]
        assert all(isinstance(k, StoredKernel) and k.plan.int8_activations for k in kernels)
        stored = {part.qtype for linear in model.linears() for part in linear.parts if part is not None}
        assert stored == {int(kind) for kind in kinds}  # as the file stores them
        assert runner_of(llm).native_decoder is not None
        assert_same_together_and_alone(llm, seed=13)
    finally:
        llm.shutdown()


def assert_same_together_and_alone(llm: LLM, seed: int) -> None:
    """With int8 activations, 20 prompts decoded together (steps of 20 rows: int8_gemm.c where the CPU
    has AVX-512 VNNI, else the rounded activations through weight_gemm.c) give the greedy tokens they
    give one at a time (steps of 1 row: block_q8.c)."""
    rng = random.Random(seed)
    prompts: list[TokensPrompt] = [
        {"prompt_token_ids": [rng.randrange(3, VOCAB_SIZE) for _ in range(10 + 3 * i)]} for i in range(20)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    for a, b in zip(together, alone, strict=True):
        assert_same_greedy(llm, a, b)


def test_gguf_quantization_refuses_float_weights(tiny_llama_hf_dir: Path) -> None:
    with pytest.raises(
        Exception,
        match=r"quantization='gguf' multiplies GGUF blocks; (lm_head|layers\.0\.\w+\.\w+) is stored as F32",
    ):
        make_llm(tiny_llama_hf_dir, quantization="gguf")
