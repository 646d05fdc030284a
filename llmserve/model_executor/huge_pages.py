"""Host tensors backed by transparent huge pages (2 MiB), for what the CPU kernels stream.

A decode step reads every weight and, at 64 sequences, some hundreds of MB of KV cache scattered in
4 KiB blocks: with 4 KiB pages nearly every weight panel and cache block costs a TLB miss and a page
walk. Where Linux hands out huge pages only on request (`transparent_hugepage=madvise`, a common
default), this asks for them. Measured here: packed fp32 products of 64-128 rows 5-17% faster, decode
attention over 64 sequences ~8%. Elsewhere (no `MADV_HUGEPAGE`, or huge pages off) it is plain memory.
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

_HUGE_PAGE = 2 << 20


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor; when it spans a huge page or more, its memory is an anonymous mapping
    advised to use huge pages before anything touches it. The tensor keeps the mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < _HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory: no THP
    with contextlib.suppress(OSError):  # huge pages compiled out of this kernel: plain pages
        memory.madvise(advice)
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def cat_huge(parts: list[torch.Tensor]) -> torch.Tensor:
    """`torch.cat(parts)` (along the first dimension) into huge-page memory."""
    shape = (sum(len(part) for part in parts), *parts[0].shape[1:])
    return torch.cat(parts, out=empty_huge(shape, parts[0].dtype))
