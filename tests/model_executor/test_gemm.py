"""kernels/gemm.c: the packed fp32 product equals F.linear, and a row's result ignores its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.model_executor.kernels import native

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler")


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 16, 32), (5, 17, 40), (6, 96, 64), (13, 50, 24), (100, 33, 72), (200, 160, 8)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_f_linear(rows: int, out_features: int, in_features: int, bias: bool) -> None:
    """Tile tails in rows (not a multiple of 6, past the 96-row pass) and in outputs (not of 16)."""
    torch.manual_seed(rows)
    weight = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    x = torch.randn(rows, in_features)
    packed = native.pack_weight(weight)
    assert packed.shape == (-(-out_features // 16), in_features, 16)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double()).float()
    torch.testing.assert_close(native.gemm(x, packed, out_features, b), expected, rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_its_batch() -> None:
    weight, x = torch.randn(70, 96), torch.randn(131, 96)
    packed = native.pack_weight(weight)
    together = native.gemm(x, packed, 70, None)
    for row in (0, 5, 97, 130):
        assert torch.equal(native.gemm(x[row : row + 1], packed, 70, None)[0], together[row])


def test_gemm_rejects_a_feature_mismatch() -> None:
    packed = native.pack_weight(torch.randn(8, 16))
    with pytest.raises(ValueError, match="features"):
        native.gemm(torch.randn(2, 32), packed, 8, None)
