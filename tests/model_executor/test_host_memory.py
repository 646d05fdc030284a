"""Host tensors for the KV cache: ordinary tensors to their users, on 2 MiB pages where Linux grants
them, made resident up front."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from llmserve.model_executor.host_memory import empty_huge, populate, populate_in_background

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kib() -> int:
    rollup = Path("/proc/self/smaps_rollup").read_text()
    return int(rollup.split("AnonHugePages:")[1].split()[0])


def test_a_large_tensor_is_writable_memory_of_its_shape() -> None:
    t = empty_huge((3, 1024, 1024), torch.float32)
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(2.0)
    assert t.sum().item() == 2.0 * t.numel()


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off here"
)
def test_its_pages_are_huge_where_the_kernel_grants_them() -> None:
    before = anon_huge_kib()
    t = empty_huge((16 << 20,), torch.uint8)
    t.fill_(1)
    assert anon_huge_kib() > before


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_populate_makes_the_pool_resident_and_keeps_what_was_written() -> None:
    t = empty_huge((64 << 20,), torch.uint8)
    t[:3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    small = torch.full((100,), 5, dtype=torch.uint8)  # malloc'd, not page-aligned
    before = resident_bytes()
    assert populate([t, small])
    assert resident_bytes() - before >= 60 << 20
    assert t[:3].tolist() == [7, 8, 9] and small.sum().item() == 500


def test_populate_in_background_ends() -> None:
    t = empty_huge((8 << 20,), torch.uint8)
    thread = populate_in_background([t])
    thread.join(timeout=60)
    assert not thread.is_alive()
