"""Our C kernels: compiled on first use with the machine's C compiler, cached, called through ctypes.

Plain C rather than a PyTorch C++ extension: against torch's headers a build takes about a minute on a
small machine, this one well under a second. The library is built for this CPU (-march=native), so the
cache key includes the CPU's flags. Without a compiler the callers keep the PyTorch path.

- `paged_attention.c`: decode attention reading the paged KV cache in place.
- `block_gemv.c`: a few rows times a weight kept in its GGUF blocks (Q4_1, Q8_0); `block_q8.c` the
  same with the rows rounded to int8 (`--quantization int8|int4`).
- `gemm.c`: fp32 rows times a weight packed once into panels, for batches and prefill.
- `decoder_step.c`: a decode step through every decoder layer, from those.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from llmserve.model_executor.huge_pages import empty_huge

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(root).expanduser() / "llmserve" / "kernels"


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) where they cannot be built."""
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.warning("Native kernels unavailable (%s %s); using PyTorch's.", error, detail.decode())
        return None
    library.paged_decode_attention.argtypes = [_PTR] * 6 + [_I64] * 7 + [ctypes.c_float, ctypes.c_int]
    library.paged_decode_attention.restype = ctypes.c_int
    library.block_gemv.argtypes = [
        _PTR,
        _I64,
        _I64,
        _PTR,
        _I64,
        ctypes.c_int,
        ctypes.c_int,
        _PTR,
        ctypes.c_int,
    ]
    library.block_gemv.restype = ctypes.c_int
    library.round_rows.argtypes = [_PTR, _I64, _I64, _PTR]
    library.pack_weight.argtypes = [_PTR, _I64, _I64, _PTR]
    library.gemm.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, ctypes.c_int]
    spec, i64, ptr = ctypes.POINTER(DecoderSpec), _I64, _PTR
    library.decoder_step.argtypes = [spec, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, ctypes.c_int]
    library.decoder_step.restype = ctypes.c_int
    return library


def _build() -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (set CC)")
    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS))
    key.update(" ".join([compiler, *_FLAGS]).encode() + _cpu_flags())
    target = cache_dir() / f"llmserve_kernels-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.stem}.{os.getpid()}.partial")
        command = [compiler, *_FLAGS, "-o", str(partial), *map(str, _SOURCES), "-lm"]
        subprocess.run(command, check=True, capture_output=True)
        os.replace(partial, target)  # atomic: concurrent builders each install a whole library
    return target


def _cpu_flags() -> bytes:
    with open("/proc/cpuinfo", "rb") as f:
        return next((line for line in f if line.startswith(b"flags")), b"")


def paged_decode_attention(
    q: torch.Tensor,  # [batch, heads, head_dim] fp32
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim] fp32
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
    seq_lens: torch.Tensor,  # [batch] int64, each >= 1
    scale: float,
) -> torch.Tensor:
    library = load_library()
    assert library is not None, "check load_library() first"
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


GGML_Q4_1, GGML_Q8_0 = 3, 8  # the block types block_gemv.c reads
BLOCK_GEMV_MAX_ROWS = 16


def block_gemv(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, out_features: int, int8_activations: bool = False
) -> torch.Tensor:
    """x [rows <= 16, in] fp32 @ W.T, W [out_features, in] held as GGUF blocks [out_features, row_bytes];
    with `int8_activations`, x rounded per block of 32 first (block_q8.c)."""
    library = load_library()
    assert library is not None, "check load_library() first"
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    status = library.block_gemv(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        blocks.data_ptr(),
        out_features,
        qtype,
        int8_activations,
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError(
            f"block_gemv cannot take x {tuple(x.shape)} with block type {qtype} (status {status})."
        )
    return y


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] fp32, each block of 32 rounded to int8 and back (block_q8.c's rounding)."""
    library = load_library()
    assert library is not None, "check load_library() first"
    x = x.contiguous()
    if x.shape[-1] % 32:
        raise ValueError(f"round_rows needs rows of 32k values, got {x.shape[-1]}.")
    out = torch.empty_like(x)
    library.round_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


GEMM_PANEL = 16  # weight rows per packed panel (gemm.c)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [out, in] fp32 → the panels `gemm` reads, [ceil(out / 16), in, 16], the last zero-padded."""
    library = load_library()
    assert library is not None, "check load_library() first"
    weight = weight.detach().contiguous()
    out_features, in_features = weight.shape
    packed = empty_huge((-(-out_features // GEMM_PANEL), in_features, GEMM_PANEL), torch.float32)
    library.pack_weight(weight.data_ptr(), out_features, in_features, packed.data_ptr())
    return packed


def gemm(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] fp32 @ W.T (+ bias), W packed by `pack_weight`."""
    library = load_library()
    assert library is not None, "check load_library() first"
    x = x.contiguous()
    if x.shape[1] != packed.shape[1]:
        raise ValueError(f"gemm: x has {x.shape[1]} features, the weight {packed.shape[1]}.")
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    library.gemm(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        packed.data_ptr(),
        out_features,
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    return y


class Projection(ctypes.Structure):
    _fields_ = [("blocks", _PTR), ("packed", _PTR), ("bias", _PTR), ("qtype", _I64)]


class LayerSpec(ctypes.Structure):
    _fields_ = [
        ("input_norm", _PTR),
        ("post_norm", _PTR),
        ("qkv", Projection),
        ("o", Projection),
        ("gate_up", Projection),
        ("down", Projection),
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
    library = load_library()
    assert library is not None, "check load_library() first"
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
