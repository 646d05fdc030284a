"""Huge-page host tensors: ordinary tensors to their users, on 2 MiB pages where Linux grants them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmserve.model_executor.huge_pages import empty_huge

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
