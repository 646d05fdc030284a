"""Our C kernels: compiled on first use with the machine's C compiler, cached, called through ctypes.

Plain C rather than a PyTorch C++ extension: against torch's headers a build takes about a minute on a
small machine, this one well under a second. The library is built for this CPU (-march=native), so the
cache key includes the CPU's flags. Without a compiler the caller keeps the PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(root).expanduser() / "llmserve" / "kernels"


@functools.cache
def load_paged_attention() -> Callable[..., int] | None:
    """The C function `paged_decode_attention`, or None (logged once) where it cannot be built."""
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.warning("Native paged attention unavailable (%s %s); using PyTorch's.", error, detail.decode())
        return None
    fn = library.paged_decode_attention
    fn.argtypes = [_PTR] * 6 + [_I64] * 7 + [ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def _build() -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (set CC)")
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join([compiler, *_FLAGS]).encode() + _cpu_flags())
    target = cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.stem}.{os.getpid()}.partial")
        command = [compiler, *_FLAGS, "-o", str(partial), str(_SOURCE), "-lm"]
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
    fn = load_paged_attention()
    assert fn is not None, "check load_paged_attention() first"
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    status = fn(
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
