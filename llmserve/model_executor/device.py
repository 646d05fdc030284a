"""Where the model runs and in which dtype, decided once from the config and the hardware."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available.")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, cpu_flags: set[str] | None = None) -> torch.dtype:
    """`auto` is bf16 on GPUs, and on CPUs with AMX's bf16 tiles; else fp32. Without AMX or AVX512-BF16
    a CPU emulates bf16 products (measured here: ~10 GFLOP/s a core against ~75 in fp32)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16
    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    return torch.bfloat16 if "amx_bf16" in flags else torch.float32


def read_cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def kv_cache_budget(device: torch.device, requested: int | None) -> int:
    """Bytes for the KV pool: as requested, else most of a GPU's free memory, else a quarter of the
    host's available memory capped at 4 GiB (enough for ~90k tokens of a small model in fp32)."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return min(4 << 30, _available_host_memory() // 4)


def _available_host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 << 30
