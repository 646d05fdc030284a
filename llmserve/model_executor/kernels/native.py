"""Our C kernels: compiled on first use with the machine's C compiler, cached, called through ctypes.

Plain C rather than a PyTorch C++ extension: against torch's headers a build takes about a minute on a
small machine, this one well under a second. The same sources are compiled once per instruction set
(`ISAS`: AVX-512, AVX2, and portable C), and the best the CPU has is chosen at start-up and logged;
`LLMSERVE_CPU_ISA=avx2` (or `generic`) forces a lower one, which is how the tests cover every variant on
one machine. Without a compiler the callers keep the PyTorch path.

- `dequant.c`: rows of a weight in its stored format (GGUF blocks, fp16, bf16) widened to fp32.
- `weight_gemm.c`: fp32 rows times a weight in its stored format, at any number of rows.
- `paged_attention.c`: decode attention reading the paged KV cache in place.
- `block_q8.c`: a few rows rounded to int8 times GGUF blocks, as integers (`--quantization gguf|int8|int4`).
- `int8_gemm.c`: the same for many rows, with AVX-512 VNNI.
- `decoder_step.c`: a decode step through every decoder layer, from those.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p

# Instruction set → (the CPU flags it needs, its compiler flags), best first. x86-64-v4 is AVX-512
# F/BW/CD/DQ/VL; v3 is AVX2 with FMA and F16C. On other CPUs only `generic`, built for the host.
ISAS: dict[str, tuple[frozenset[str], list[str]]] = {
    "avx512": (frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}), ["-march=x86-64-v4"]),
    "avx2": (frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"}), ["-march=x86-64-v3"]),
    "generic": (frozenset(), ["-march=x86-64"] if platform.machine() in ("x86_64", "AMD64") else ["-O3"]),
}


def cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(root).expanduser() / "llmserve" / "kernels"


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
        library = ctypes.CDLL(str(_build(isa)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.warning("Native kernels unavailable (%s %s); using PyTorch's.", error, detail.decode())
        return None
    logger.info("Native kernels: %s build.", isa)
    library.kernels_isa.restype = ctypes.c_char_p
    library.paged_decode_attention.argtypes = [_PTR] * 6 + [_I64] * 7 + [ctypes.c_float, ctypes.c_int]
    library.paged_decode_attention.restype = ctypes.c_int
    library.block_gemv.argtypes = [_PTR, _I64, _I64, ctypes.POINTER(Weight), _I64, _PTR, ctypes.c_int]
    library.block_gemv.restype = ctypes.c_int
    library.int8_gemm.argtypes = [_PTR, _I64, _I64, ctypes.POINTER(Weight), _I64, _PTR, ctypes.c_int]
    library.int8_gemm.restype = ctypes.c_int
    library.int8_gemm_available.restype = ctypes.c_int
    library.round_rows.argtypes = [_PTR, _I64, _I64, _PTR]
    library.is_block_type.argtypes = [ctypes.c_int]
    library.row_bytes.argtypes = [ctypes.c_int, _I64]
    library.row_bytes.restype = _I64
    library.dequantize_rows.argtypes = [_PTR, ctypes.c_int, _I64, _PTR, _I64, _PTR, ctypes.c_int]
    library.dequantize_rows.restype = ctypes.c_int
    library.weight_gemm.argtypes = [_PTR, _I64, _I64, ctypes.POINTER(Weight), _PTR, ctypes.c_int]
    library.weight_gemm.restype = ctypes.c_int
    spec, i64, ptr = ctypes.POINTER(DecoderSpec), _I64, _PTR
    library.decoder_step.argtypes = [spec, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    library.decoder_step.restype = ctypes.c_int
    return library


def _build(isa: str) -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (set CC)")
    flags = [*_FLAGS, *ISAS[isa][1]]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS))
    key.update(" ".join([compiler, *flags]).encode())
    target = cache_dir() / f"llmserve_kernels-{isa}-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.stem}.{os.getpid()}.partial")
        command = [compiler, *flags, "-o", str(partial), *map(str, _SOURCES), "-lm"]
        subprocess.run(command, check=True, capture_output=True)
        os.replace(partial, target)  # atomic: concurrent builders each install a whole library
    return target


def library_isa(library: ctypes.CDLL) -> str:
    """The instruction set `library` was compiled for, as the compiler's macros in it say."""
    return str(library.kernels_isa().decode())


def _library() -> ctypes.CDLL:
    library = load_library()
    assert library is not None, "check load_library() first"
    return library


def paged_decode_attention(
    q: torch.Tensor,  # [batch, heads, head_dim] fp32
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim] fp32
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
    seq_lens: torch.Tensor,  # [batch] int64, each >= 1
    scale: float,
) -> torch.Tensor:
    library = _library()
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
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
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("paged_decode_attention could not allocate its score buffer.")
    return out


BLOCK_GEMV_MAX_ROWS = 16


def block_gemv(x: torch.Tensor, weight: Weight, out_features: int) -> torch.Tensor:
    """x [rows <= 16, in] fp32, rounded to int8 per block of 32, @ W.T (+ bias), W [out_features, in] in
    GGUF blocks (block_q8.c: what decode steps with int8 activations compute)."""
    status, y = _int8_product("block_gemv", x, weight, out_features)
    if status != 0:
        types = sorted({weight.parts[i].qtype for i in range(weight.num_parts)})
        raise ValueError(
            f"block_gemv cannot take x {tuple(x.shape)} with block types {types} (status {status})."
        )
    return y


def int8_gemm_available() -> bool:
    """Whether the selected build has int8_gemm.c's products on this CPU (AVX-512 VNNI)."""
    return bool(_library().int8_gemm_available())


def int8_gemm(x: torch.Tensor, weight: Weight, out_features: int) -> torch.Tensor | None:
    """x [rows, in] fp32, rounded to int8 per block of 32 as block_gemv rounds it, @ W.T (+ bias), W in
    GGUF blocks, for many rows (int8_gemm.c); None where this CPU (see int8_gemm_available) or W has no
    such product."""
    status, y = _int8_product("int8_gemm", x, weight, out_features)
    if status == -2:
        raise MemoryError("int8_gemm could not allocate its buffers.")
    return y if status == 0 else None


def _int8_product(
    kernel: str, x: torch.Tensor, weight: Weight, out_features: int
) -> tuple[int, torch.Tensor]:
    """The C kernel `kernel`'s status and y for x [rows, in] @ W.T."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    function = getattr(_library(), kernel)
    threads = torch.get_num_threads()
    status = function(
        x.data_ptr(), x.shape[0], x.shape[1], ctypes.byref(weight), out_features, y.data_ptr(), threads
    )
    return int(status), y


def is_block_type(qtype: int) -> bool:
    """Whether block_gemv multiplies weights of this GGML type: the GGUF block types."""
    return bool(_library().is_block_type(qtype))


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] fp32, each block of 32 rounded to int8 and back (block_q8.c's rounding)."""
    library = _library()
    x = x.contiguous()
    if x.shape[-1] % 32:
        raise ValueError(f"round_rows needs rows of 32k values, got {x.shape[-1]}.")
    out = torch.empty_like(x)
    library.round_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def row_bytes(qtype: int, in_features: int) -> int:
    """Bytes of one row of `in_features` weights stored as `qtype`; 0 for a type or width we do not read."""
    return int(_library().row_bytes(qtype, in_features))


def dequantize_rows(data: torch.Tensor, qtype: int, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] int64 of a weight stored as `qtype`, data [rows, row_bytes] uint8 → [n, in] fp32:
    an embedding lookup, or (all ids) the whole weight, with the values `gguf.quants.dequantize` gives."""
    ids = ids.contiguous()
    out = torch.empty(ids.shape[0], in_features, dtype=torch.float32)
    status = _library().dequantize_rows(
        data.data_ptr(),
        qtype,
        in_features,
        ids.data_ptr(),
        ids.shape[0],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(f"dequantize_rows cannot read type {qtype} at width {in_features}.")
    return out


MAX_WEIGHT_PARTS = 3


class WeightPart(ctypes.Structure):
    _fields_ = [("data", _PTR), ("qtype", _I64), ("rows", _I64)]


class Weight(ctypes.Structure):
    """weight_gemm.c's view of a stored weight: up to three parts of rows stacked, and a bias. The tensors
    behind the addresses must outlive it."""

    _fields_ = [("parts", WeightPart * MAX_WEIGHT_PARTS), ("num_parts", _I64), ("bias", _PTR)]


def weight_gemm(x: torch.Tensor, weight: Weight, out_features: int) -> torch.Tensor:
    """x [rows, in] fp32 @ W.T (+ bias), W stored as `weight` describes."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    status = _library().weight_gemm(
        x.data_ptr(), x.shape[0], x.shape[1], ctypes.byref(weight), y.data_ptr(), torch.get_num_threads()
    )
    if status != 0:
        raise ValueError(f"weight_gemm cannot take x {tuple(x.shape)} with this weight's types.")
    return y


class LayerSpec(ctypes.Structure):
    _fields_ = [
        ("input_norm", _PTR),
        ("post_norm", _PTR),
        ("qkv", Weight),
        ("o", Weight),
        ("gate_up", Weight),
        ("down", Weight),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
    ]


class DecoderSpec(ctypes.Structure):
    """decoder_step.c's view of a model: its shapes and the addresses of its weights and KV cache. The
    tensors behind the addresses must outlive it."""

    _fields_ = [
        *((name, _I64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim")),
        *((name, _I64) for name in ("intermediate", "num_blocks", "block_size", "int8_activations")),
        ("block_rows", _I64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(LayerSpec)),
        ("rope_cos", _PTR),
        ("rope_sin", _PTR),
        ("final_norm", _PTR),
    ]


def decoder_step(
    spec: DecoderSpec,
    x: torch.Tensor,  # [rows, hidden] fp32, the embedded tokens; overwritten
    positions: torch.Tensor,  # [rows] int64
    slots: torch.Tensor,  # [rows] int64
    block_tables: torch.Tensor,  # [rows, max_blocks] int64
    seq_lens: torch.Tensor,  # [rows] int64, including the new token
) -> torch.Tensor:
    """Hidden states [rows, hidden] after the final norm; writes each layer's new K and V to the cache."""
    library = _library()
    assert x.is_contiguous() and block_tables.is_contiguous()
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
    if status != 0:
        raise ValueError(f"decoder_step cannot take {x.shape[0]} rows of this model (status {status}).")
    return out
