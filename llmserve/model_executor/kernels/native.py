"""Our C kernels: compiled on first use with the machine's C compiler, cached, called through ctypes.

Plain C rather than a PyTorch C++ extension: against torch's headers a build takes about a minute on a
small machine, this one well under a second. The same sources are compiled once per instruction set
(`ISAS`: AVX-512 with and without VNNI, AVX2, and portable C), and the best the CPU has is chosen at
start-up and logged; `LLMSERVE_CPU_ISA=avx512` (or `avx2`, `generic`) forces a lower one, which is how
the tests cover every variant on one machine. Without a compiler the callers keep the PyTorch path, with
a warning; with `LLMSERVE_REQUIRE_NATIVE=1` (as CI sets) a build or load failure is an error carrying
the compiler's output instead. build.py compiles; structs.py holds the ctypes structs, checked against
the C layout at load, and signatures.py each function's ctypes declaration, checked against its C
prototype at load. The wrappers check what they pass (dtypes, contiguity, shapes) and the kernels the
block tables' bounds, raising ValueError: a wrong tensor would otherwise be read as raw memory.

- `dequant.c`: rows of a weight in its stored format (GGUF blocks, fp16, bf16) widened to fp32.
- `weight_gemm.c`: fp32 rows times a weight in its stored format, at any number of rows.
- `paged_attention.c`: decode attention reading the paged KV cache in place, within a sliding window.
- `block_q8.c`: a few rows rounded to int8 times GGUF blocks, as integers (`--quantization gguf|int8|int4`).
- `int8_gemm.c`: the same for many rows, with AVX-512 VNNI.
- `decoder_step.c`: a decode step through every decoder layer, from those.
- `gated_activation.c`: the MLP's act(gate) * up of decoder_step.c, for the other steps.
- `argmax.c`: each row's argmax, as torch.argmax gives it, for sampling.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

import torch

from llmserve.model_executor.kernels.build import BuildError, build, cache_dir
from llmserve.model_executor.kernels.signatures import declare, signature_mismatches
from llmserve.model_executor.kernels.structs import (
    ACTIVATIONS,
    BLOCK_GEMV_MAX_ROWS,
    MAX_WEIGHT_PARTS,
    QK,
    DecoderSpec,
    KernelStatus,
    LayerSpec,
    Weight,
    WeightPart,
    layout_mismatches,
)

__all__ = [
    "ACTIVATIONS",
    "BLOCK_GEMV_MAX_ROWS",
    "MAX_WEIGHT_PARTS",
    "DecoderSpec",
    "LayerSpec",
    "Weight",
    "WeightPart",
    "cache_dir",
]

logger = logging.getLogger(__name__)

# Instruction set → (the CPU flags it needs, its compiler flags), best first. x86-64-v4 is AVX-512
# F/BW/CD/DQ/VL; `avx512_vnni` adds the int8 multiply-add that block_q8.c's products take in one
# instruction; v3 is AVX2 with FMA and F16C. On other CPUs only `generic`,
# built for the host.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
ISAS: dict[str, tuple[frozenset[str], list[str]]] = {
    "avx512_vnni": (_AVX512 | {"avx512_vnni"}, ["-march=x86-64-v4", "-mavx512vnni"]),
    "avx512": (_AVX512, ["-march=x86-64-v4"]),
    "avx2": (frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"}), ["-march=x86-64-v3"]),
    "generic": (frozenset(), ["-march=x86-64"] if platform.machine() in ("x86_64", "AMD64") else ["-O3"]),
}


@functools.cache  # every kernel call asks for its library, so the flags are read once
def cpu_flags() -> frozenset[str]:
    with open("/proc/cpuinfo") as f:
        line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


@functools.cache
def supported_isas() -> tuple[str, ...]:
    """The instruction sets this CPU runs, best first."""
    flags = cpu_flags()
    return tuple(isa for isa, (needs, _) in ISAS.items() if needs <= flags)


def selected_isa() -> str:
    """The best supported instruction set, or `LLMSERVE_CPU_ISA` where it names a supported one."""
    supported = supported_isas()
    forced = os.environ.get("LLMSERVE_CPU_ISA")
    if forced is None:
        return supported[0]
    if forced not in supported:
        raise ValueError(f"LLMSERVE_CPU_ISA={forced!r}: this CPU runs {', '.join(supported)}.")
    return forced


def load_library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for `isa` (default: `selected_isa()`), or None (logged once) where they cannot
    be built."""
    return _load(isa or selected_isa())


@functools.cache
def _load(isa: str) -> ctypes.CDLL | None:
    try:
        library = ctypes.CDLL(str(build(isa, ISAS[isa][1])))
    except (OSError, BuildError) as error:
        if os.environ.get("LLMSERVE_REQUIRE_NATIVE") == "1":
            raise RuntimeError(f"LLMSERVE_REQUIRE_NATIVE=1, but the {isa} kernels failed: {error}") from error
        logger.warning("Native kernels unavailable (%s); using PyTorch's.", error)
        return None
    mismatches = layout_mismatches(library)
    if mismatches:  # a bug in this package, not the machine: never a silent fallback
        raise RuntimeError(f"The ctypes structs or constants differ from C's: {'; '.join(mismatches)}.")
    mismatches = signature_mismatches(library)
    if mismatches:
        raise RuntimeError(f"The ctypes declarations differ from C's prototypes: {'; '.join(mismatches)}.")
    declare(library)
    logger.info("Native kernels: %s build.", isa)
    return library


def library_isa(library: ctypes.CDLL) -> str:
    """The instruction set `library` was compiled for, as the compiler's macros in it say."""
    return str(library.kernels_isa().decode())


def _library() -> ctypes.CDLL:
    library = load_library()
    if library is None:
        raise RuntimeError("The C kernels are unavailable: check load_library() before calling them.")
    return library


def _check(name: str, tensor: torch.Tensor, dtype: torch.dtype, ndim: int) -> None:
    """ValueError unless `tensor` is a contiguous CPU tensor of `dtype` and `ndim` dimensions, which is
    how the kernels read the memory at its address."""
    if (
        tensor.dtype != dtype
        or tensor.dim() != ndim
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
    ):
        raise ValueError(
            f"{name} must be a contiguous {ndim}-D CPU {dtype} tensor, got {tensor.dtype}"
            f" {tuple(tensor.shape)} on {tensor.device} (contiguous: {tensor.is_contiguous()})."
        )


def _check_rows(rows: int, **tensors: torch.Tensor) -> None:
    """ValueError unless each of `tensors` is a contiguous int64 tensor of `rows` rows: block_tables
    [rows, max_blocks], the others [rows]."""
    for name, tensor in tensors.items():
        _check(name, tensor, torch.int64, 2 if name == "block_tables" else 1)
        if tensor.shape[0] != rows:
            raise ValueError(f"{name} must have {rows} rows, got shape {tuple(tensor.shape)}.")


def _check_weight(weight: Weight, out_features: int) -> None:
    """ValueError unless `weight` has 1 to MAX_WEIGHT_PARTS parts of `out_features` rows in all."""
    if not 1 <= weight.num_parts <= MAX_WEIGHT_PARTS:
        raise ValueError(f"A weight has 1 to {MAX_WEIGHT_PARTS} parts, got {weight.num_parts}.")
    rows = sum(weight.parts[i].rows for i in range(weight.num_parts))
    if rows != out_features:
        raise ValueError(f"out_features is {out_features}, but the weight's parts have {rows} rows.")


def _check_fits_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.dtype:
    """ValueError unless q [rows, heads, head_dim] fits head-major caches [kv_heads, blocks, block_size,
    head_dim] of one shape, its heads a multiple of theirs; fp32 or bf16 caches and queries of their dtype
    or fp32 (`--kv-cache-dtype bfloat16` under an fp32 model). Returns the caches' dtype."""
    dtype = k_cache.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"The attention kernels read fp32 or bf16 caches, not {dtype}.")
    if q.dtype not in (dtype, torch.float32):
        raise ValueError(f"q must be float32 or the caches' {dtype}, got {q.dtype}.")
    _check("q", q, q.dtype, 3)
    _check("k_cache", k_cache, dtype, 4)
    _check("v_cache", v_cache, dtype, 4)
    num_heads, head_dim = q.shape[1:]
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != head_dim or num_heads % k_cache.shape[0]:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} and {tuple(v_cache.shape)}."
        )
    return dtype


def paged_decode_attention(
    q: torch.Tensor,  # [batch, heads, head_dim], the caches' dtype or fp32
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim], fp32 or bf16
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
    seq_lens: torch.Tensor,  # [batch] int64, each in [1, max_blocks * block_size]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Each query attends to the last `sliding_window` keys of its sequence (all of them when None); the
    blocks before those are never read, so their table entries need only be valid ids. bf16 caches and
    queries are computed with in fp32 (a bf16 widens exactly), the output in q's dtype (a bf16 one rounded
    once)."""
    library = _library()
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}.")
    q = q.contiguous()
    dtype, q_dtype = _check_fits_caches(q, k_cache, v_cache), q.dtype
    q = q.float()
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    _check_rows(batch, block_tables=block_tables, seq_lens=seq_lens)
    out = torch.empty_like(q)
    status = library.paged_decode_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        block_tables.shape[1],
        sliding_window or 0,
        dtype == torch.bfloat16,
        scale,
        torch.get_num_threads(),
    )
    if status == KernelStatus.OUT_OF_BOUNDS:
        raise ValueError(f"paged_decode_attention: a length or block id out of bounds ({num_blocks} blocks).")
    if status != KernelStatus.OK:
        raise MemoryError("paged_decode_attention could not allocate its score buffer.")
    return out.to(q_dtype)


def prefill_attention(
    q: torch.Tensor,  # [q_len, heads, head_dim], the caches' dtype or fp32: positions context_len ..
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim] fp32 or bf16, this step's keys
    v_cache: torch.Tensor,  # written
    block_table: torch.Tensor,  # [n] int64: the sequence's blocks, covering its last query's position
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """One sequence's chunk of queries, each attending causally to its keys (the last `sliding_window`
    of them when given), read in place from the caches (prefill_attention.c); None where head_dim is not
    a multiple of the build's vectors, which the caller then attends another way. As in
    `paged_decode_attention`, bf16 is computed with in fp32, the output in q's dtype."""
    library = _library()
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}.")
    _check("block_table", block_table, torch.int64, 1)
    dtype, q_dtype = _check_fits_caches(q, k_cache, v_cache), q.dtype
    q = q.float()
    q_len, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    out = torch.empty_like(q)
    status = library.prefill_attention(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.shape[0],
        context_len,
        q_len,
        out.data_ptr(),
        num_heads,
        num_kv_heads,
        head_dim,
        num_blocks,
        block_size,
        sliding_window or 0,
        dtype == torch.bfloat16,
        scale,
        torch.get_num_threads(),
    )
    if status == KernelStatus.UNSUPPORTED:
        return None
    if status == KernelStatus.OUT_OF_BOUNDS:
        raise ValueError(
            f"prefill_attention: the table ({block_table.shape[0]} blocks) does not cover positions up to"
            f" {context_len + q_len - 1}, or holds an id outside [0, {num_blocks})."
        )
    if status != KernelStatus.OK:
        raise MemoryError("prefill_attention could not allocate its buffers.")
    return out.to(q_dtype)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of x [rows, n] fp32 (n >= 1) as [rows] int64: the same indices, ties and NaNs
    included, read with vectors (argmax.c)."""
    x = x.contiguous()
    _check("x", x, torch.float32, 2)
    rows, n = x.shape
    if n < 1 or n >= 2**31:
        raise ValueError(f"argmax_rows takes rows of 1 to 2^31 - 1 values, got {n}.")
    out = torch.empty(rows, dtype=torch.int64)
    _library().argmax_rows(x.data_ptr(), rows, n, out.data_ptr(), torch.get_num_threads())
    return out


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of gate_up [rows, 2 * inter] fp32 (each row's gate, then its up) as [rows, inter]:
    the activation decoder_step.c computes (a vector e^x; within ~1e-6 of PyTorch's)."""
    gate_up = gate_up.contiguous()
    _check("gate_up", gate_up, torch.float32, 2)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gated_activation takes rows of a gate and an up of one width, got {width} values.")
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    _library().gated_activation(
        gate_up.data_ptr(), rows, width // 2, ACTIVATIONS[activation], out.data_ptr(), torch.get_num_threads()
    )
    return out


def block_gemv(
    x: torch.Tensor, weight: Weight, out_features: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [rows <= 16, in] fp32, rounded to int8 per block of 32, @ W.T (+ bias), W [out_features, in] in
    GGUF blocks (block_q8.c: what decode steps with int8 activations compute); into `out` where given."""
    status, y = _int8_product("block_gemv", x, weight, out_features, out)
    if status != KernelStatus.OK:
        types = sorted({weight.parts[i].qtype for i in range(weight.num_parts)})
        raise ValueError(
            f"block_gemv cannot take x {tuple(x.shape)} with block types {types} (status {status})."
        )
    return y


def int8_gemm_available() -> bool:
    """Whether the selected build has int8_gemm.c's products on this CPU (AVX-512 VNNI)."""
    return bool(_library().int8_gemm_available())


def int8_gemm(
    x: torch.Tensor, weight: Weight, out_features: int, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x [rows, in] fp32, rounded to int8 per block of 32 as block_gemv rounds it, @ W.T (+ bias), W in
    GGUF blocks, for many rows (int8_gemm.c), into `out` where given; None where this CPU (see
    int8_gemm_available) or W has no such product."""
    status, y = _int8_product("int8_gemm", x, weight, out_features, out)
    if status == KernelStatus.NO_MEMORY:
        raise MemoryError("int8_gemm could not allocate its buffers.")
    return y if status == KernelStatus.OK else None


def _int8_product(
    kernel: str, x: torch.Tensor, weight: Weight, out_features: int, out: torch.Tensor | None
) -> tuple[int, torch.Tensor]:
    """The C kernel `kernel`'s status and y for x [rows, in] @ W.T."""
    function = getattr(_library(), kernel)
    x = x.contiguous()
    _check("x", x, torch.float32, 2)
    _check_weight(weight, out_features)
    y = _output(x.shape[0], out_features, out)
    threads = torch.get_num_threads()
    status = function(
        x.data_ptr(), x.shape[0], x.shape[1], ctypes.byref(weight), out_features, y.data_ptr(), threads
    )
    return int(status), y


def _output(rows: int, out_features: int, out: torch.Tensor | None) -> torch.Tensor:
    """`out`, checked to be a product's y [rows, out_features] fp32, or a new one."""
    if out is None:
        return torch.empty(rows, out_features, dtype=torch.float32)
    _check("out", out, torch.float32, 2)
    if tuple(out.shape) != (rows, out_features):
        raise ValueError(f"out must have shape {(rows, out_features)}, got {tuple(out.shape)}.")
    return out


def is_block_type(qtype: int) -> bool:
    """Whether block_gemv multiplies weights of this GGML type: the GGUF block types."""
    return bool(_library().is_block_type(qtype))


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] fp32, each block of 32 rounded to int8 and back (block_q8.c's rounding)."""
    library = _library()
    x = x.contiguous()
    _check("x", x, torch.float32, 2)
    if x.shape[-1] % QK:
        raise ValueError(f"round_rows needs rows of {QK}k values, got {x.shape[-1]}.")
    out = torch.empty_like(x)
    library.round_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of `in_features` weights stored as `qtype`; 0 for a type or width we do not read."""
    return int(_library().row_bytes(qtype, in_features))


def dequantize_rows(data: torch.Tensor, qtype: int, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] int64 of a weight stored as `qtype`, data [rows, row_bytes] uint8 → [n, in] fp32:
    an embedding lookup, or (all ids) the whole weight, with the values `gguf.quants.dequantize` gives.
    `data` may also be typed as its elements ([rows, in] float16 for F16), as long as its rows are whole."""
    library = _library()
    ids = ids.contiguous()
    _check("data", data, data.dtype, 2)
    data = data.view(torch.uint8)  # read as bytes, whatever numpy typed them as (a GGUF's F16 is float16)
    _check("ids", ids, torch.int64, 1)
    expected = library.row_bytes(qtype, in_features)
    if expected and data.shape[1] != expected:
        raise ValueError(
            f"dequantize_rows: rows of type {qtype} at width {in_features} are {expected} bytes,"
            f" got data {tuple(data.shape)}."
        )
    out = torch.empty(ids.shape[0], in_features, dtype=torch.float32)
    status = library.dequantize_rows(
        data.data_ptr(),
        qtype,
        in_features,
        data.shape[0],
        ids.data_ptr(),
        ids.shape[0],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status == KernelStatus.OUT_OF_BOUNDS:
        raise ValueError(f"dequantize_rows: an id outside [0, {data.shape[0]}).")
    if status != KernelStatus.OK:
        raise ValueError(f"dequantize_rows cannot read type {qtype} at width {in_features}.")
    return out


def weight_gemm(
    x: torch.Tensor, weight: Weight, out_features: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [rows, in] fp32 @ W.T (+ bias), W stored as `weight` describes; into `out` where given."""
    library = _library()
    x = x.contiguous()
    _check("x", x, torch.float32, 2)
    _check_weight(weight, out_features)
    y = _output(x.shape[0], out_features, out)
    status = library.weight_gemm(
        x.data_ptr(), x.shape[0], x.shape[1], ctypes.byref(weight), y.data_ptr(), torch.get_num_threads()
    )
    if status != KernelStatus.OK:
        raise ValueError(f"weight_gemm cannot take x {tuple(x.shape)} with this weight's types.")
    return y


def decoder_step(
    spec: DecoderSpec,
    x: torch.Tensor,  # [rows, hidden] fp32, the embedded tokens or the layers' before; overwritten
    positions: torch.Tensor,  # [rows] int64
    slots: torch.Tensor,  # [rows] int64
    block_tables: torch.Tensor,  # [rows, max_blocks] int64
    seq_lens: torch.Tensor,  # [rows] int64, including the new token
) -> torch.Tensor:
    """Hidden states [rows, hidden] after the spec's layers and the final norm (the residual stream where
    the spec has none); writes each layer's new K and V to the cache."""
    library = _library()
    _check("x", x, torch.float32, 2)
    if x.shape[1] != spec.hidden:
        raise ValueError(f"decoder_step: x {tuple(x.shape)} is not [rows, {spec.hidden}].")
    _check_rows(x.shape[0], positions=positions, slots=slots, block_tables=block_tables, seq_lens=seq_lens)
    out = torch.empty_like(x)
    status = library.decoder_step(
        ctypes.byref(spec),
        x.data_ptr(),
        positions.data_ptr(),
        slots.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        x.shape[0],
        block_tables.shape[1],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status == KernelStatus.OUT_OF_BOUNDS:
        raise ValueError(
            f"decoder_step: a position, slot, length or block id out of bounds ({spec.num_blocks} blocks)."
        )
    if status != KernelStatus.OK:
        raise ValueError(f"decoder_step cannot take {x.shape[0]} rows of this model (status {status}).")
    return out
