"""block_q8.c, the few rows of a decode step with int8 activations against GGUF blocks of every type,
computes the rounded x @ W.T for the dequantized W, under every instruction-set build this CPU runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.stored_weight import StoredTensor, StoredWeight
from tests.model_executor.isas import TESTED_ISAS
from tests.model_executor.stored_weights import (
    K_TYPES,
    QUANTIZABLE,
    random_stored_tensor,
    real_stored_tensor,
    real_tensor_per_type,
    reference,
)

round_activations = native.round_rows


@pytest.fixture(autouse=True, params=TESTED_ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("LLMSERVE_CPU_ISA", request.param)
    assert native.load_library() is not None, "the C kernels must build here"
    return str(request.param)


def stored_weight(
    parts: list[StoredTensor], bias: torch.Tensor | None = None
) -> tuple[StoredWeight, torch.Tensor]:
    """The weight, and gguf's fp32 values of it."""
    values = torch.cat([torch.from_numpy(reference(p.data.numpy(), Q(p.qtype))) for p in parts])
    return StoredWeight(parts, bias), values.reshape(-1, parts[0].in_features)


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, native.BLOCK_GEMV_MAX_ROWS])
def test_int8_activations_times_every_block_type(qtype: Q, rows: int) -> None:
    weight, values = stored_weight([random_stored_tensor(qtype, 67, 768, seed=rows)])
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, 32:64] = 0.0  # a block of zeros: scale 0
    rounded = round_activations(x)
    assert not torch.equal(rounded, x)
    expected = (rounded.double() @ values.double().T).float()
    actual = native.block_gemv(x, weight.native, 67)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_TYPES)
@pytest.mark.parametrize("rows", [1, 17, 64, 300])
def test_int8_gemm_times_every_block_type(isa: str, qtype: Q, rows: int) -> None:
    """Many rows (int8_gemm.c): the same rounded product, on AVX-512 VNNI; elsewhere no product (None)."""
    weight, values = stored_weight([random_stored_tensor(qtype, 67, 768, seed=rows)], torch.randn(67))
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows)) * 3
    actual = native.int8_gemm(x, weight.native, 67)
    if not isa.startswith("avx512") or "avx512_vnni" not in native.cpu_flags():
        assert actual is None
        return
    assert weight.bias is not None
    expected = (round_activations(x).double() @ values.double().T).float() + weight.bias
    assert actual is not None
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())


def assert_rounded_product_close(y: torch.Tensor, x: torch.Tensor, values: torch.Tensor) -> None:
    """y within fp32 rounding of the fp64 product of the int8-rounded x and W's values: |error| <=
    1e-5 * sum |rounded x * w| for each output (the int8 dot products are exact; the scales are not)."""
    rounded = round_activations(x).double()
    exact = rounded @ values.double().T
    bound = 1e-5 * (rounded.abs() @ values.double().abs().T) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all(), (y.double() - exact).abs().div(bound).max()


@real_tensor_per_type
@pytest.mark.parametrize("rows", [1, 3, 8, native.BLOCK_GEMV_MAX_ROWS])
def test_int8_activations_times_real_blocks(model: str, name: str, qtype: Q, rows: int) -> None:
    """Blocks of the packaged models (Q4_K, Q6_K, Q5_0, Q8_0, Q4_1), the few rows of a decode step."""
    weight, values = stored_weight([real_stored_tensor(model, name, qtype)])
    x = torch.randn(rows, values.shape[1], generator=torch.Generator().manual_seed(rows)) * 3
    assert_rounded_product_close(native.block_gemv(x, weight.native, weight.out_features), x, values)


@real_tensor_per_type
@pytest.mark.parametrize("rows", [64, 300])
def test_int8_gemm_times_real_blocks(isa: str, model: str, name: str, qtype: Q, rows: int) -> None:
    """Many rows: the same rounded product on AVX-512 VNNI; elsewhere no product (None)."""
    weight, values = stored_weight([real_stored_tensor(model, name, qtype)])
    x = torch.randn(rows, values.shape[1], generator=torch.Generator().manual_seed(rows)) * 3
    actual = native.int8_gemm(x, weight.native, weight.out_features)
    if not isa.startswith("avx512") or "avx512_vnni" not in native.cpu_flags():
        assert actual is None
        return
    assert actual is not None
    assert_rounded_product_close(actual, x, values)


@pytest.mark.parametrize("rows", [2, 40])
def test_each_part_of_a_fused_weight_is_read_and_the_bias_added(rows: int) -> None:
    """Parts of three types: int8_gemm.c's first panel of 32 outputs is all Q5_0 (a scale per 32, no
    offsets), its second mixes Q5_0, Q6_K and Q4_K rows (a scale per 16, and Q4_K's minimum as an offset
    per 32), its third is one Q4_K row (a scale and an offset per 32)."""
    parts = [
        random_stored_tensor(qtype, n, 512, seed=i)
        for i, (qtype, n) in enumerate([(Q.Q5_0, 40), (Q.Q6_K, 9), (Q.Q4_K, 16)])
    ]
    bias = torch.randn(65)
    weight, values = stored_weight(parts, bias)
    x = torch.randn(rows, 512)
    expected = round_activations(x) @ values.T + bias
    if rows <= native.BLOCK_GEMV_MAX_ROWS:
        torch.testing.assert_close(native.block_gemv(x, weight.native, 65), expected, rtol=1e-5, atol=1e-4)
    many = native.int8_gemm(x, weight.native, 65)
    if many is not None:
        torch.testing.assert_close(many, expected, rtol=1e-5, atol=1e-4)


def test_products_write_into_a_given_output() -> None:
    """`out` is filled and returned (the model keeps one for a step's logits); a wrong one is refused."""
    weight, values = stored_weight([random_stored_tensor(Q.Q8_0, 40, 256)])
    for rows, product in [
        (3, native.block_gemv),
        (20, native.int8_gemm),
        (20, native.weight_gemm),
    ]:
        x = torch.randn(rows, 256)
        out = torch.full((rows, 40), float("nan"))
        y = product(x, weight.native, 40, out)
        if y is None:  # int8_gemm on a CPU without VNNI
            continue
        assert y is out
        torch.testing.assert_close(y, product(x, weight.native, 40))
        with pytest.raises(ValueError, match="shape"):
            product(x, weight.native, 40, torch.empty(rows + 1, 40))


def test_round_activations_keeps_int8_steps_per_block() -> None:
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3))
    blocks = x.reshape(3, 3, 32)
    steps = round_activations(x).reshape(3, 3, 32) / (blocks.abs().amax(-1, keepdim=True) / 127)
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
    torch.testing.assert_close(steps.abs().amax(-1), torch.full((3, 3), 127.0))  # the block's largest


def test_rounding_equals_its_definition_bit_for_bit() -> None:
    """s * round-half-even(x * (1 / s)), s = max |x| / 127, each step in fp32: the AVX builds' vectors and
    the portable loop give these bits, ties and all-zero blocks included."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5)) * 3
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[2, :31] = torch.arange(31) - 15.5  # with s = 1 (max |x| 127), x * (1 / s) lands on halves
    x[2, 31] = 127.0
    blocks = x.numpy().reshape(-1, 32)
    s = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    inverse = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s != 0)
    expected = torch.from_numpy((np.rint(blocks * inverse) * s).reshape(5, 256))
    assert expected.dtype == torch.float32
    assert torch.equal(round_activations(x), expected)


def test_block_gemv_refuses_what_it_cannot_read() -> None:
    blocks = StoredTensor(int(Q.Q8_0), torch.from_numpy(quantize(np.ones((4, 64), np.float32), Q.Q8_0)), 64)
    with pytest.raises(ValueError, match="block types"):
        native.block_gemv(
            torch.ones(native.BLOCK_GEMV_MAX_ROWS + 1, 64), StoredWeight([blocks], None).native, 4
        )
    floats = random_stored_tensor(Q.F16, 4, 64)
    with pytest.raises(ValueError, match="block types"):
        native.block_gemv(torch.ones(1, 64), StoredWeight([floats], None).native, 4)
    k_type = random_stored_tensor(Q.Q4_K, 4, 256)
    with pytest.raises(ValueError, match="block types"):  # rows of 256 read as rows of 64
        native.block_gemv(torch.ones(1, 64), StoredWeight([k_type], None).native, 4)
