"""The linear layers compute what `F.linear` computes: dense through oneDNN, stored through our kernels,
with no dense copy of a stored weight; the thread count follows the rules."""

from __future__ import annotations

import os
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config import ModelConfig
from llmserve.model_executor.cpu_threads import core_thread_count
from llmserve.model_executor.execution_plan import ExecutionPlan, cpu_has_bf16_products
from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.linear import Linear, OneDNNKernel, StoredKernel
from llmserve.model_executor.layers.stored_weight import StoredTensor, StoredWeight
from llmserve.model_executor.quantization import requantize
from tests.model_executor.isas import TESTED_ISAS
from tests.model_executor.stored_weights import Q, cpu_plan, random_stored_tensor

BLOCK_ROWS = native.BLOCK_GEMV_MAX_ROWS


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_fp32_is_onednn(rows: int, bias: bool) -> None:
    layer = Linear(48, 80, bias, stored=False)
    weight = cast(nn.Parameter, layer.weight)  # stored=False: a dense weight, never None
    torch.nn.init.normal_(weight)
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 48)
    expected = F.linear(x, weight, layer.bias)
    layer.prepare(cpu_plan(stored=False))
    assert isinstance(layer.kernel, OneDNNKernel)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_dense_bf16_is_onednn_with_f_linears_values(rows: int) -> None:
    """`--dtype bfloat16` on a CPU with bf16 instructions: the weight packed once, F.linear's values up
    to the last bf16 rounding (the two sum in different orders); elsewhere `F.linear` itself."""
    torch.manual_seed(rows)
    layer = Linear(96, 80, True, stored=False).bfloat16()
    weight = cast(nn.Parameter, layer.weight)  # stored=False: a dense weight, never None
    torch.nn.init.normal_(weight)
    assert layer.bias is not None
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(rows, 96).bfloat16()
    expected = F.linear(x, weight, layer.bias)
    config = ModelConfig(native_kernels=True)
    layer.prepare(ExecutionPlan.decide(config, torch.device("cpu"), torch.bfloat16, "LlamaForCausalLM"))
    if cpu_has_bf16_products():
        assert isinstance(layer.kernel, OneDNNKernel)
    else:
        assert layer.kernel is None
    torch.testing.assert_close(layer(x), expected, rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 33])
def test_stored_floats_keep_their_bytes(dtype: torch.dtype, rows: int) -> None:
    """A Hugging Face weight kept in its own dtype (2 bytes for bf16/fp16), multiplied in fp32."""
    weight, bias = torch.randn(96, 64).to(dtype), torch.randn(96)
    layer = Linear(64, 96, True, stored=True)
    assert layer.weight is None
    layer.parts[0] = StoredTensor.from_dense(weight)
    layer.bias = torch.nn.Parameter(bias)
    layer.prepare(cpu_plan())
    assert isinstance(layer.kernel, StoredKernel)
    assert layer.kernel.weight.nbytes == weight.numel() * dtype.itemsize
    x = torch.randn(rows, 64)
    torch.testing.assert_close(layer(x), F.linear(x, weight.float(), bias), rtol=1e-5, atol=1e-5)


def test_fp16_quantization_is_f_linear_on_fp16_rounded_weights() -> None:
    weight = torch.randn(96, 64)
    [part] = requantize([StoredTensor.from_dense(weight)], "fp16", "w")
    layer = Linear(64, 96, False, stored=True)
    layer.parts[0] = part
    layer.prepare(cpu_plan())
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), F.linear(x, weight.half().float()), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer(x), F.linear(x, weight), rtol=0, atol=1e-7)


def test_int8_and_int4_need_whole_blocks() -> None:
    with pytest.raises(ValueError, match="32k"):
        requantize([StoredTensor.from_dense(torch.randn(4, 48))], "int8", "w")


def test_gguf_keeps_the_blocks_and_refuses_floats() -> None:
    blocks = random_stored_tensor(Q.Q4_K, 8, 256)
    assert requantize([blocks], "gguf", "w") == [blocks]
    with pytest.raises(ValueError, match="layers.0.mlp.down_proj is stored as F16"):
        requantize([blocks, random_stored_tensor(Q.F16, 8, 256)], "gguf", "layers.0.mlp.down_proj")


@pytest.mark.parametrize("isa", TESTED_ISAS)
@pytest.mark.parametrize("rows", [1, BLOCK_ROWS, BLOCK_ROWS + 1])
def test_int8_activations_multiply_the_rounded_rows_at_every_batch_size(
    rows: int, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past BLOCK_ROWS: int8_gemm.c where the build and CPU have it, else weight_gemm.c on rounded rows."""
    monkeypatch.setenv("LLMSERVE_CPU_ISA", isa)
    parts = [random_stored_tensor(Q.Q6_K, 40, 512), random_stored_tensor(Q.Q5_0, 24, 512, seed=1)]
    kernel = StoredKernel(StoredWeight(parts, None), cpu_plan("int8"))
    vnni = isa.startswith("avx512") and "avx512_vnni" in native.cpu_flags()
    assert kernel.plan.int8_gemm == vnni
    values = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(rows, 512)
    expected = (native.round_rows(x).double() @ values.double().T).float()
    torch.testing.assert_close(kernel(x), expected, rtol=1e-5, atol=1e-4)


def test_core_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert core_thread_count(5) == 5
    assert core_thread_count(None) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert core_thread_count(None) == len(os.sched_getaffinity(0))
