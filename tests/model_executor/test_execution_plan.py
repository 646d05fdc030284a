"""The execution plan's rules, one test each: what runs where, decided once at load."""

from __future__ import annotations

import pytest
import torch

from llmserve.config import ModelConfig
from llmserve.model_executor import execution_plan
from llmserve.model_executor.execution_plan import (
    ArgmaxKernel,
    DecodeAttentionKernel,
    DenseProduct,
    ExecutionPlan,
    GatedActivationKernel,
    PrefillAttentionKernel,
    StoredProduct,
)
from llmserve.model_executor.kernels import native
from llmserve.model_executor.models.registry import model_class, supported_architectures

CPU, FP32 = torch.device("cpu"), torch.float32


def plan(
    quantization: str = "none",
    native_kernels: bool = True,
    device: torch.device = CPU,
    dtype: torch.dtype = FP32,
) -> ExecutionPlan:
    config = ModelConfig(quantization=quantization, native_kernels=native_kernels)  # type: ignore[arg-type]
    return ExecutionPlan.decide(config, device, dtype, "LlamaForCausalLM")


def test_cpu_fp32_with_the_library_keeps_stored_weights_and_runs_our_kernels() -> None:
    p = plan()
    assert native.load_library() is not None
    assert p.stored_weights and p.decode_attention is DecodeAttentionKernel.C and p.fused_decode
    assert p.reasons == ()


def test_fp32_activations_take_weight_gemm_at_every_batch_size() -> None:
    p = plan()
    assert {p.stored_product(rows) for rows in (1, 16, 17, 512)} == {StoredProduct.WEIGHT_GEMM}


@pytest.mark.parametrize("quantization", ["gguf", "int8", "int4"])
def test_int8_activations_at_small_batches_take_the_block_kernel(quantization: str) -> None:
    p = plan(quantization)
    assert p.block_rows == native.BLOCK_GEMV_MAX_ROWS
    assert p.stored_product(1) is StoredProduct.BLOCKS_AS_INTEGERS
    assert p.stored_product(p.block_rows) is StoredProduct.BLOCKS_AS_INTEGERS


def test_int8_activations_at_large_batches_take_int8_gemm_only_with_vnni() -> None:
    p = plan("int8")
    many = p.stored_product(p.block_rows + 1)
    if native.int8_gemm_available():
        assert p.int8_gemm and many is StoredProduct.INT8_GEMM
    else:
        assert not p.int8_gemm and many is StoredProduct.ROUNDED_THEN_WEIGHT_GEMM


def test_without_our_kernels_weights_are_dense_through_onednn_and_torch_attention() -> None:
    p = plan(native_kernels=False)
    assert not p.stored_weights and not p.fused_decode
    assert p.decode_attention is DecodeAttentionKernel.TORCH and p.dense_product() is DenseProduct.ONEDNN
    assert any("native_kernels=False" in reason for reason in p.reasons)


def test_bf16_compute_takes_pytorch_but_for_the_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    p = plan(dtype=torch.bfloat16)
    assert not p.stored_weights and not p.fused_decode
    assert p.decode_attention is DecodeAttentionKernel.C and p.gated_activation is GatedActivationKernel.TORCH
    assert p.prefill_attention is PrefillAttentionKernel.C
    assert any("bfloat16" in reason for reason in p.reasons)
    half = plan(dtype=torch.float16)
    assert (
        half.decode_attention is DecodeAttentionKernel.TORCH
        and half.prefill_attention is PrefillAttentionKernel.TORCH_SDPA
    )
    monkeypatch.setattr(execution_plan, "cpu_has_bf16_products", lambda: True)
    assert (
        p.dense_product() is DenseProduct.ONEDNN
        and plan(dtype=torch.float16).dense_product() is DenseProduct.TORCH
    )
    monkeypatch.setattr(execution_plan, "cpu_has_bf16_products", lambda: False)
    assert p.dense_product() is DenseProduct.TORCH


def test_sampling_argmax_takes_the_c_kernel_on_the_cpu_with_the_library() -> None:
    assert plan().argmax is ArgmaxKernel.C and plan(dtype=torch.bfloat16).argmax is ArgmaxKernel.C
    assert plan(native_kernels=False).argmax is ArgmaxKernel.TORCH
    assert plan(device=torch.device("cuda"), dtype=torch.bfloat16).argmax is ArgmaxKernel.TORCH


def test_the_mlp_activation_takes_the_decode_steps_c_code_wherever_decodes_read_the_cache_in_c() -> None:
    assert plan().gated_activation is GatedActivationKernel.C is plan("gguf").gated_activation
    assert plan(dtype=torch.bfloat16).gated_activation is GatedActivationKernel.TORCH
    assert plan(native_kernels=False).gated_activation is GatedActivationKernel.TORCH
    assert (
        plan(device=torch.device("cuda"), dtype=torch.bfloat16).gated_activation
        is GatedActivationKernel.TORCH
    )
    encoder = ExecutionPlan.decide(ModelConfig(), CPU, FP32, "BertModel", encoder=True)
    assert encoder.gated_activation is GatedActivationKernel.TORCH


def test_a_gpu_holds_dense_weights_for_pytorch_everywhere() -> None:
    p = plan(device=torch.device("cuda"), dtype=torch.bfloat16)
    assert not p.stored_weights and not p.fused_decode and p.decode_attention is DecodeAttentionKernel.TORCH
    assert p.dense_product() is DenseProduct.TORCH
    assert any("device cuda" in reason for reason in p.reasons)


def test_a_library_that_did_not_build_leaves_pytorch_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "load_library", lambda isa=None: None)
    p = plan()
    assert not p.stored_weights and not p.fused_decode
    assert p.decode_attention is DecodeAttentionKernel.TORCH and p.argmax is ArgmaxKernel.TORCH
    assert any("unavailable" in reason for reason in p.reasons)


def test_an_encoder_holds_dense_weights_through_onednn_and_never_decodes() -> None:
    config = ModelConfig()
    p = ExecutionPlan.decide(config, CPU, FP32, "BertModel", encoder=True)
    assert p.encoder and not p.stored_weights and not p.fused_decode
    assert p.decode_attention is DecodeAttentionKernel.TORCH and p.dense_product() is DenseProduct.ONEDNN
    assert "no KV cache" in " ".join(p.describe())
    with pytest.raises(ValueError, match="BertModel is an encoder"):
        ExecutionPlan.decide(ModelConfig(quantization="gguf"), CPU, FP32, "BertModel", encoder=True)


def test_a_model_whose_layers_misfit_decoder_step_decodes_op_by_op_and_says_why() -> None:
    p = plan().without_fused_decode("decoder_step.c rotates whole heads; X rotates part of each")
    assert p.stored_weights and p.decode_attention is DecodeAttentionKernel.C and not p.fused_decode
    assert p.reasons[-1].endswith("rotates part of each: decodes run op by op")
    assert "  decode-only steps: op by op" in p.describe()


def test_quantization_without_our_kernels_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization='int8' needs the CPU"):
        plan("int8", native_kernels=False)


def test_the_plan_prints_in_a_few_lines() -> None:
    lines = plan("gguf").describe()
    assert 3 <= len(lines) <= 8
    assert "block_q8.c" in lines[1] and "decoder_step.c" in lines[3]


def test_the_registry_names_one_class_per_architecture_and_refuses_others() -> None:
    assert model_class("MistralForCausalLM") is model_class("LlamaForCausalLM")
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*LlamaForCausalLM"):
        model_class("GPT2LMHeadModel")
    assert "Qwen2ForCausalLM" in supported_architectures()
