"""The C kernels fail loudly: a failed build is an error where LLMSERVE_REQUIRE_NATIVE=1 asks for one (as
CI does), warnings are errors in the tests, the ctypes structs match the C layout and the ctypes
declarations the C prototypes, what the wrappers pass is checked with ValueError, and the kernel tests
run clean under AddressSanitizer and UBSan."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from llmserve.model_executor.kernels import build, native, signatures, structs

FAKE_CC = """#!/bin/sh
# Records its arguments; fails with a message, or writes an empty library where -o says.
echo "$@" >> "$0.log"
[ -n "$FAKE_CC_FAIL" ] && { echo "fake-cc: error: the kernels do not compile" >&2; exit 1; }
while [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done
"""


@pytest.fixture
def fake_cc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A compiler that builds nothing, into an empty cache; the loaded libraries are forgotten after."""
    cc = tmp_path / "cc"
    cc.write_text(FAKE_CC)
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "cache"))
    native._load.cache_clear()
    yield cc
    native._load.cache_clear()


def test_a_failed_build_is_an_error_where_native_is_required(
    fake_cc: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FAKE_CC_FAIL", "1")
    monkeypatch.setenv("LLMSERVE_REQUIRE_NATIVE", "1")
    with pytest.raises(RuntimeError, match="(?s)LLMSERVE_REQUIRE_NATIVE=1.*the kernels do not compile"):
        native.load_library()
    monkeypatch.delenv("LLMSERVE_REQUIRE_NATIVE")
    with caplog.at_level(logging.WARNING):
        assert native.load_library() is None
    assert "the kernels do not compile" in caplog.text and "using PyTorch's" in caplog.text


def test_warnings_are_errors_where_asked_and_in_a_build_of_their_own(
    fake_cc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMSERVE_KERNEL_WERROR", "1")
    strict = build.build("generic", [])
    monkeypatch.delenv("LLMSERVE_KERNEL_WERROR")
    lenient = build.build("generic", [])
    assert strict != lenient and strict.exists() and lenient.exists()
    strict_args, lenient_args = Path(f"{fake_cc}.log").read_text().splitlines()
    assert {"-Wall", "-Wextra", "-Werror"} <= set(strict_args.split())
    assert {"-Wall", "-Wextra"} <= set(lenient_args.split()) and "-Werror" not in lenient_args.split()


def test_the_tests_build_with_warnings_as_errors() -> None:
    """tests/conftest.py sets it before the first build, so that a new warning fails the kernel tests."""
    assert os.environ.get("LLMSERVE_KERNEL_WERROR") == "1"
    assert "-Werror" in build.compile_flags([])


def test_the_ctypes_structs_match_the_c_layout(native_library: ctypes.CDLL) -> None:
    assert structs.layout_mismatches(native_library) == []


def test_a_struct_that_drifted_from_c_is_caught(native_library: ctypes.CDLL) -> None:
    class Weight(ctypes.Structure):  # num_parts and bias swapped, and a field C does not have
        _fields_ = [
            ("parts", structs.WeightPart * structs.MAX_WEIGHT_PARTS),
            ("bias", ctypes.c_void_p),
            ("num_parts", ctypes.c_int64),
            ("extra", ctypes.c_int64),
        ]

    assert structs.layout_mismatches(native_library, (Weight,), {}) == [
        "Weight: Python 96, C 88",
        "Weight.bias: Python 72, C 80",
        "Weight.num_parts: Python 80, C 72",
        "Weight.extra: Python 88, C -1",
    ]


def test_a_constant_that_drifted_from_c_is_caught(native_library: ctypes.CDLL) -> None:
    drifted = {**structs.CONSTANTS, "MLP_GATED": 1, "MLP_SPARSE": 2}
    assert structs.layout_mismatches(native_library, (), drifted) == [
        "MLP_GATED: Python 1, C 0",
        "MLP_SPARSE: Python 2, C -1",
    ]


def test_the_ctypes_declarations_match_the_c_prototypes(native_library: ctypes.CDLL) -> None:
    assert signatures.signature_mismatches(native_library) == []
    assert native_library.decoder_step.argtypes == signatures.SIGNATURES["decoder_step"][1]


def test_a_declaration_that_drifted_from_c_is_caught(native_library: ctypes.CDLL) -> None:
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    drifted: dict[str, signatures.Signature] = {
        **signatures.SIGNATURES,
        "weight_gemm": (i32, [ptr, i64, i32, ptr, ptr, i32]),  # k narrowed, the Weight passed as void *
        "argmax_rows": (i32, [ptr, i64, i64, ptr, i32]),  # a return value C does not give
        "top_k": (None, [ptr, i64]),
    }
    del drifted["row_bytes"]
    assert signatures.signature_mismatches(native_library, drifted) == [
        "weight_gemm: Python i32(p, i64, i32, p, p, i32), C i32(p, i64, i64, Weight*, p, i32)",
        "argmax_rows: Python i32(p, i64, i64, p, i32), C void(p, i64, i64, p, i32)",
        "top_k: Python void(p, i64), C none",
        "row_bytes: Python none, C i64(i32, i64)",
    ]


def caches(num_blocks: int = 4, block_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, num_blocks, block_size, 8), torch.zeros(1, num_blocks, block_size, 8)


@pytest.mark.usefixtures("native_library")
@pytest.mark.parametrize(
    ("table", "lens", "match"),
    [
        ([[0, 4]], [8], "out of bounds"),  # block 4 of 4
        ([[0, -1]], [5], "out of bounds"),
        ([[0, 1]], [9], "out of bounds"),  # 9 tokens in a table of 2 blocks of 4
        ([[0, 1]], [0], "out of bounds"),
        ([[0, 1]], [4, 4], "seq_lens must have 1 rows"),
    ],
)
def test_attention_refuses_tables_out_of_bounds(table: list, lens: list, match: str) -> None:
    q = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match=match):
        native.paged_decode_attention(q, *caches(), torch.tensor(table), torch.tensor(lens), 1.0)


@pytest.mark.usefixtures("native_library")
def test_attention_refuses_wrong_dtypes_and_layouts() -> None:
    q, table, lens = torch.randn(1, 2, 8), torch.tensor([[0, 1]]), torch.tensor([5])
    k, v = caches()
    native.paged_decode_attention(q, k, v, table, lens, 1.0)  # as given, it runs
    for args, match in [
        ((q, k, v, table.int(), lens), "block_tables must be a contiguous 2-D CPU torch.int64"),
        ((q, k.double(), v.double(), table, lens), "fp32 or bf16 caches, not torch.float64"),
        ((q, k, v.bfloat16(), table, lens), "v_cache must be .* torch.float32"),
        (
            (q.half(), k.bfloat16(), v.bfloat16(), table, lens),
            "q must be float32 or the caches. torch.bfloat16",
        ),
        ((q, k, v.transpose(1, 2), table, lens), r"contiguous: False"),
        ((q, k, v[..., :4].contiguous(), table, lens), "does not fit caches"),
        ((q.double(), k, v, table, lens), "q must be"),
    ]:
        with pytest.raises(ValueError, match=match):
            native.paged_decode_attention(*args, 1.0)


@pytest.mark.usefixtures("native_library")
def test_products_refuse_wrong_dtypes_and_row_counts() -> None:
    data = torch.randn(6, 32)
    weight = native.Weight(num_parts=1)
    weight.parts[0] = native.WeightPart(data.data_ptr(), 0, 6)  # F32
    assert native.weight_gemm(torch.randn(2, 32), weight, 6).shape == (2, 6)
    with pytest.raises(ValueError, match="x must be .* torch.float32"):
        native.weight_gemm(torch.randn(2, 32, dtype=torch.bfloat16), weight, 6)
    with pytest.raises(ValueError, match="out_features is 7, but the weight's parts have 6 rows"):
        native.weight_gemm(torch.randn(2, 32), weight, 7)
    with pytest.raises(ValueError, match="x must be a contiguous 2-D"):
        native.round_rows(torch.randn(32))


@pytest.mark.usefixtures("native_library")
def test_lookups_refuse_ids_out_of_range() -> None:
    data = torch.randn(6, 32).view(torch.uint8)
    assert native.dequantize_rows(data, 0, 32, torch.tensor([5])).shape == (1, 32)
    for ids in ([6], [-1]):
        with pytest.raises(ValueError, match=r"an id outside \[0, 6\)"):
            native.dequantize_rows(data, 0, 32, torch.tensor(ids))
    with pytest.raises(ValueError, match="rows of type 0 at width 16 are 64 bytes"):
        native.dequantize_rows(data, 0, 16, torch.tensor([0]))


@pytest.mark.usefixtures("native_library")
@pytest.mark.parametrize(
    ("slot", "position", "table", "length"),
    [(16, 0, [0, 1], 1), (-1, 0, [0, 1], 1), (0, -1, [0, 1], 1), (0, 0, [0, 4], 5), (0, 0, [0, 1], 9)],
)
def test_decoder_step_refuses_positions_slots_and_tables_out_of_bounds(
    slot: int, position: int, table: list[int], length: int
) -> None:
    """Checked before any weight is read: this spec has no layers at all."""
    spec = native.DecoderSpec(num_layers=0, hidden=32, num_heads=1, num_kv_heads=1, head_dim=8)
    spec.num_blocks, spec.block_size = 4, 4
    with pytest.raises(ValueError, match="out of bounds"):
        native.decoder_step(
            spec,
            torch.zeros(1, 32),
            torch.tensor([position]),
            torch.tensor([slot]),
            torch.tensor([table]),
            torch.tensor([length]),
        )


# What the sanitizers run: each kernel's tests under the best build only (`-k isa`), one sanitized compile.
SANITIZED_TESTS = [
    "tests/model_executor/test_native_attention.py::test_native_decode_equals_fp64_attention",
    "tests/model_executor/test_native_attention.py::test_native_decode_reads_bf16_caches_as_their_fp32_values",
    "tests/model_executor/test_native_attention.py::test_native_prefill_equals_fp64_attention",
    "tests/model_executor/test_native_attention.py::test_native_prefill_reads_bf16_caches_as_their_fp32_values",
    "tests/model_executor/test_sliding_window_attention.py::test_decode_equals_windowed_reference",
    "tests/model_executor/test_weight_kernels.py",
    "tests/model_executor/test_block_q8.py",
]

# A product over a weight that claims one row more than its data holds: a read past the tensor's end.
OVERFLOW = """
import torch
from llmserve.model_executor.kernels import native
data = torch.randn(6, 32)
weight = native.Weight(num_parts=1)
weight.parts[0] = native.WeightPart(data.data_ptr(), 0, 7)
native.weight_gemm(torch.randn(1, 32), weight, 7)
"""


def run_sanitized(*args: str) -> subprocess.CompletedProcess[str]:
    """Python running `args` with the kernels built under ASan and UBSan. Python is not built with ASan,
    so its runtime is preloaded; leak checks would report Python's own allocations."""
    libasan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout
    if not Path(libasan.strip()).is_absolute():
        pytest.fail(f"No libasan.so beside gcc ({libasan.strip()!r}): install it with gcc.")
    env = {
        **os.environ,
        "LD_PRELOAD": libasan.strip(),
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        "LLMSERVE_KERNEL_SANITIZE": "address,undefined",
        "LLMSERVE_REQUIRE_NATIVE": "1",
    }
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=600)


def test_kernel_tests_pass_under_address_and_undefined_behaviour_sanitizers() -> None:
    """A sanitizer report ends the run with a non-zero status (halt_on_error); the run that reads past
    a tensor shows that the sanitized library is the one loaded and that its reads are checked."""
    isa = native.supported_isas()[0]
    result = run_sanitized("-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", isa, *SANITIZED_TESTS)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    assert " passed" in result.stdout
    overflow = run_sanitized("-c", OVERFLOW)
    assert overflow.returncode != 0 and "heap-buffer-overflow" in overflow.stderr, overflow.stderr[-3000:]
    assert "weight_gemm" in overflow.stderr
