"""Weights in their stored formats, under every instruction-set build this CPU runs: dequantization equals
`gguf`'s bit for bit, and products equal gguf's dequantization followed by an fp64 product."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from llmserve.model_executor.kernels import native
from tests.model_executor.stored_weights import (
    ALL_TYPES,
    Q,
    real_stored_tensor,
    real_tensor_per_type,
    real_tensors,
    reference,
)
from tests.model_executor.stored_weights import random_stored as stored


def assert_product_close(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """Within fp32 rounding of the fp64 product: |error| <= 1e-5 * sum |x * w| for each output."""
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((y.double() - exact).abs() <= bound).all(), (y.double() - exact).abs().div(bound).max()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """The kernels' thread count (torch's, which native.py passes on) set to n for a block, then restored."""
    with_threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(with_threads)


def one_part(raw: np.ndarray, qtype: Q, bias: torch.Tensor | None = None) -> tuple[native.Weight, list]:
    data = torch.from_numpy(np.ascontiguousarray(raw))
    weight = native.Weight(num_parts=1, bias=0 if bias is None else bias.data_ptr())
    weight.parts[0] = native.WeightPart(data.data_ptr(), int(qtype), raw.shape[0])
    return weight, [data, bias]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_dequantize_equals_gguf_bit_for_bit(isa: str, qtype: Q) -> None:
    raw = stored(qtype, 7, 512)
    ids = torch.tensor([6, 0, 3, 3])
    ours = native.dequantize_rows(torch.from_numpy(raw), int(qtype), 512, ids)
    expected = torch.from_numpy(reference(raw, qtype))[ids]
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
def test_product_equals_fp64_of_gguf_values(isa: str, qtype: Q, rows: int) -> None:
    out_features, in_features = 37, 512  # 37: no multiple of any tile; 512: whole K super-blocks
    raw = stored(qtype, out_features, in_features, seed=rows)
    bias = torch.randn(out_features)
    weight, keep = one_part(raw, qtype, bias)
    x = torch.randn(rows, in_features)
    y = native.weight_gemm(x, weight, out_features)
    assert_product_close(y, x, torch.from_numpy(reference(raw, qtype)), bias)


@real_tensors
def test_real_blocks_dequantize_as_gguf_does_bit_for_bit(isa: str, model: str, name: str, qtype: Q) -> None:
    """Blocks of the packaged models: the scales, mins and high bits a trained model has."""
    weight = real_stored_tensor(model, name, qtype)
    ids = torch.randperm(weight.rows, generator=torch.Generator().manual_seed(0))
    ours = native.dequantize_rows(weight.data, weight.qtype, weight.in_features, ids)
    expected = torch.from_numpy(reference(weight.data.numpy(), qtype))[ids]
    assert expected.count_nonzero() > expected.numel() // 2
    assert torch.equal(ours, expected)


@real_tensor_per_type
@pytest.mark.parametrize("rows", [1, 3, 6, 16, 17, 64, 300])
def test_product_of_real_blocks_equals_fp64_of_gguf_values(
    isa: str, model: str, name: str, qtype: Q, rows: int
) -> None:
    """1 to 300 rows take weight_gemm.c's ways (up to 4 rows from registers, up to 16 from weights widened
    as they are read, more in tiles)."""
    weight = real_stored_tensor(model, name, qtype)
    native_weight, keep = one_part(weight.data.numpy(), qtype)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows))
    y = native.weight_gemm(x, native_weight, weight.rows)
    assert_product_close(y, x, torch.from_numpy(reference(weight.data.numpy(), qtype)))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("in_features", [75, 3147])
def test_product_of_odd_width_floats(isa: str, qtype: Q, in_features: int) -> None:
    """Hugging Face weights need not be whole blocks: the tail of k past the vectors counts too, in one
    slice or after chains carried over two (3,147 = 1,024 + 1,024 + 1,099, the tail in the last), and
    the same for a row in either tile of 7 rows as in 2."""
    raw = stored(qtype, 9, in_features)
    weight, keep = one_part(raw, qtype)
    x = torch.randn(7, in_features)
    y = native.weight_gemm(x, weight, 9)
    assert_product_close(y, x, torch.from_numpy(reference(raw, qtype)))
    assert torch.equal(native.weight_gemm(x[:2], weight, 9), y[:2])


@pytest.mark.parametrize("rows", [1, 10, 150])
@pytest.mark.parametrize("in_features", [256, 2560])
def test_parts_of_different_types_stack(isa: str, rows: int, in_features: int) -> None:
    """A fused projection whose shards are stored in different types (Q4_K_M's q, k and v), at a decode
    step's row (each group of output rows found from its number, the parts' last groups partial), at ten
    and at 150 (more than one pass of the tiles), over one slice of columns and over two, on one thread
    and on two (few enough that a thread's groups, whose chains go from slice to slice together, span the
    parts)."""
    parts = [(Q.Q4_K, 20), (Q.Q6_K, 7), (Q.Q8_0, 5)]
    raws = [stored(qtype, n, in_features, seed=i) for i, (qtype, n) in enumerate(parts)]
    tensors = [torch.from_numpy(raw) for raw in raws]
    weight = native.Weight(num_parts=3, bias=0)
    for i, ((qtype, n), data) in enumerate(zip(parts, tensors)):
        weight.parts[i] = native.WeightPart(data.data_ptr(), int(qtype), n)
    x = torch.randn(rows, in_features)
    w = torch.cat([torch.from_numpy(reference(raw, qtype)) for raw, (qtype, _) in zip(raws, parts)])
    for threads in (1, 2):
        with torch_threads(threads):
            assert_product_close(native.weight_gemm(x, weight, 32), x, w)


# Widths of one slice of weight_gemm.c's columns and of several (its slices are 1,024 columns long, the
# last up to half as long again: 8,448's last is 1,280).
WIDTHS = [768, 2 * 4096 + 256]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("in_features", WIDTHS)
def test_product_over_slices_equals_fp64_of_gguf_values(isa: str, qtype: Q, in_features: int) -> None:
    """A decode row and 150 rows (more than one pass of the tiles over a group's rows, their chains carried
    from slice to slice) at both widths, the bias added once."""
    raw = stored(qtype, 13, in_features)
    bias = torch.randn(13)
    weight, keep = one_part(raw, qtype, bias)
    for rows in (1, 150):
        x = torch.randn(rows, in_features)
        y = native.weight_gemm(x, weight, 13)
        assert_product_close(y, x, torch.from_numpy(reference(raw, qtype)), bias)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("in_features", WIDTHS)
def test_a_rows_result_does_not_depend_on_its_batch(isa: str, qtype: Q, in_features: int) -> None:
    """Bit for bit, alone, among 3 (the register path) or among 150 rows, on one thread or all: what the
    README promises."""
    raw = stored(qtype, 50, in_features)
    weight, keep = one_part(raw, qtype)
    x = torch.randn(150, in_features)
    whole = native.weight_gemm(x, weight, 50)
    for at in (0, 5, 96, 147):
        assert torch.equal(native.weight_gemm(x[at : at + 1], weight, 50)[0], whole[at])
        assert torch.equal(native.weight_gemm(x[at : at + 3], weight, 50), whole[at : at + 3])
    with torch_threads(1):
        assert torch.equal(native.weight_gemm(x, weight, 50), whole)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("in_features", WIDTHS)
def test_a_sequences_speculated_rows_match_the_other_paths(isa: str, qtype: Q, in_features: int) -> None:
    """A sequence's row with 4 to 15 speculated tokens (5 to 16 rows: each slice of a group's blocks
    widened once as it is read, then tiles) gives, bit for bit, what it gives alone (from registers) and
    among 150 (tiles of weights widened ahead), on one thread or all; 17 rows too. Every type, one slice
    and several with a short last one (8,448 = 8 x 1,024 + 256), 50 output features: a partial group of
    W's rows at the end."""
    raw = stored(qtype, 50, in_features, seed=in_features)
    weight, keep = one_part(raw, qtype)
    x = torch.randn(150, in_features, generator=torch.Generator().manual_seed(1))
    whole = native.weight_gemm(x, weight, 50)
    alone = torch.cat([native.weight_gemm(x[i : i + 1], weight, 50) for i in range(20)])
    assert torch.equal(alone, whole[:20])
    for rows in (5, 6, 7, 8, 9, 12, 16, 17):
        for at in (0, 3):
            assert torch.equal(native.weight_gemm(x[at : at + rows], weight, 50), whole[at : at + rows]), rows
        with torch_threads(1):
            assert torch.equal(native.weight_gemm(x[:rows], weight, 50), whole[:rows]), rows
    assert_product_close(whole[:8], x[:8], torch.from_numpy(reference(raw, qtype)))


def test_unknown_types_and_widths_are_refused(isa: str) -> None:
    raw = stored(Q.Q4_K, 4, 256)
    weight, keep = one_part(raw, Q.Q4_K)
    with pytest.raises(ValueError, match="weight_gemm"):
        native.weight_gemm(torch.randn(2, 128), weight, 4)  # 128 is no whole super-block
    with pytest.raises(ValueError, match="dequantize_rows"):
        native.dequantize_rows(torch.from_numpy(raw), int(Q.IQ2_XS), 256, torch.tensor([0]))


def test_forcing_an_isa_the_cpu_lacks_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSERVE_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match="LLMSERVE_CPU_ISA"):
        native.load_library()


def test_the_best_build_the_cpu_runs_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Here, by the code the compiler emitted; and on an AVX2-only CPU (its flags stood in), by name."""
    monkeypatch.delenv("LLMSERVE_CPU_ISA", raising=False)
    library = native.load_library()
    assert library is not None, "the C kernels must build here"
    assert native.selected_isa() == native.supported_isas()[0]
    assert native.library_isa(library) == native.supported_isas()[0]

    flags = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "movbe"})
    monkeypatch.setattr(native, "cpu_flags", lambda: flags)
    native.supported_isas.cache_clear()
    try:
        assert native.supported_isas() == ("avx2", "generic")
        assert native.selected_isa() == "avx2"
        monkeypatch.setenv("LLMSERVE_CPU_ISA", "avx512")
        with pytest.raises(ValueError, match="this CPU runs avx2, generic"):
            native.selected_isa()
    finally:
        native.supported_isas.cache_clear()  # the real flags again, once monkeypatch restores them


def test_a_forced_isa_loads_that_build(isa: str) -> None:
    """`LLMSERVE_CPU_ISA` (set by the fixture) picks the file, and the file holds that build's code."""
    library = native.load_library()
    assert library is not None and native.selected_isa() == isa
    assert native.library_isa(library) == isa
    assert Path(library._name).name.startswith(f"llmserve_kernels-{isa}-")
