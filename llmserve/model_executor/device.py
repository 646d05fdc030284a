"""Where the model runs, in which dtype and on how many threads, decided once from the config and the
hardware."""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from llmserve.model_executor.cpu_threads import core_thread_count

M = TypeVar("M", bound=nn.Module)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available.")
    return torch.device(device)


def configure_core_threads(requested: int | None) -> int:
    """torch's compute threads for this engine core (see cpu_threads.py); returns their count."""
    count = core_thread_count(requested)
    torch.set_num_threads(count)
    return count


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on GPUs and fp32 on CPUs: there the exact path, whose greedy output equals
    Hugging Face's fp32, and the one that multiplies weights in their stored format. `--dtype bfloat16`
    computes in bf16 through PyTorch (oneDNN uses AMX or AVX512-BF16 where the CPU has them)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def materialize(model: M, device: torch.device, dtype: torch.dtype) -> M:
    """A model built on the meta device, given uninitialised storage for the weights to load into.
    `Module.to_empty` would do it through `empty_like`, whose meta-tensor path imports sympy: a third
    of a second of the engine core's start-up. Floating-point tensors take `dtype`, as `.to(dtype)`
    would give them."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    return model._apply(empty)


def kv_cache_budget(device: torch.device, requested: int | None, ranks: int = 1) -> int:
    """Bytes for the KV pool: as requested, else most of a GPU's free memory, else a quarter of the
    host's available memory capped at 4 GiB (enough for ~90k tokens of a small model in fp32), shared
    by the `ranks` data-parallel ranks, so that N ranks use what one core would."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return min(4 << 30, _available_host_memory() // 4) // ranks


def _available_host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30
