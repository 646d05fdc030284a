"""The CPU linear kernels compute what `F.linear` computes; the thread count follows the rules."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from llmserve.model_executor.cpu_threads import core_thread_count
from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.linear import (
    Fp16WeightKernel,
    Linear,
    OneDNNKernel,
    PackedKernel,
    make_kernel,
)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("native_kernels", [False, True])
def test_fp32_kernels_match_f_linear(rows: int, bias: bool, native_kernels: bool) -> None:
    if native_kernels and native.load_library() is None:
        pytest.skip("no C compiler")
    layer = Linear(48, 80, bias=bias)
    x = torch.randn(rows, 48)
    expected = F.linear(x, layer.weight, layer.bias)
    layer.prepare("none", native_kernels)
    assert isinstance(layer.kernel, PackedKernel if native_kernels else OneDNNKernel)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 33])
def test_fp16_kernel_is_f_linear_on_fp16_rounded_weights(rows: int) -> None:
    layer = Linear(64, 96, bias=True)
    x = torch.randn(rows, 64)
    exact = F.linear(x, layer.weight, layer.bias)
    expected = F.linear(x, layer.weight.half().float(), layer.bias)
    layer.prepare("fp16", native_kernels=True)
    assert isinstance(layer.kernel, Fp16WeightKernel)
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(layer(x), exact, rtol=0, atol=1e-7)
    assert layer.weight.numel() == 0  # the kernel's copy is the only one left


def test_fp16_weights_need_cpu_fp32() -> None:
    with pytest.raises(ValueError, match="fp16"):
        make_kernel(torch.randn(4, 4, dtype=torch.bfloat16), None, "fp16", True)


def test_reduced_precision_keeps_f_linear() -> None:
    assert make_kernel(torch.randn(4, 4, dtype=torch.bfloat16), None, "none", True) is None


def test_core_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert core_thread_count(5) == 5
    assert core_thread_count(None) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert core_thread_count(None) == len(os.sched_getaffinity(0))
