"""The KV pool's host memory: an ordinary tensor to its users, made resident without losing a write."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch

from llmserve.model_executor import host_memory
from llmserve.model_executor.host_memory import empty_pool, populate, populate_in_background


def resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_it_is_writable_memory_of_its_shape() -> None:
    t = empty_pool((3, 1024, 1024), torch.float32)
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    t.fill_(2.0)
    assert t.sum().item() == 2.0 * t.numel()
    assert empty_pool((0, 4), torch.float32).shape == (0, 4)


def resident_pages(t: torch.Tensor) -> list[bool]:
    """mincore(2) of a page-aligned tensor's pages."""
    page = mmap.PAGESIZE
    pages = -(-t.numel() * t.element_size() // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(t.data_ptr(), pages * page, vec) == 0, ctypes.get_errno()
    return [bool(v & 1) for v in vec]


def test_populate_makes_the_blocks_resident_and_keeps_what_was_written() -> None:
    t = empty_pool((2, 32, 1 << 20), torch.uint8)  # [outer, blocks, ...]: 64 MiB
    t[0, 0, :3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    small = torch.full((1, 1, 100), 5, dtype=torch.uint8)  # malloc'd, not page-aligned
    before = resident_bytes()
    assert populate([t], range(32)) and populate([small], range(1))
    assert resident_bytes() - before >= 60 << 20
    assert t[0, 0, :3].tolist() == [7, 8, 9] and small.sum().item() == 500


def test_populate_goes_a_run_of_blocks_at_a_time_in_order_and_only_those_asked() -> None:
    """Blocks are resident in the order the pool hands them out, in every outer row (every head) of
    every tensor, before they are reported; blocks outside the range stay untouched."""
    block = 64 << 10  # so that a run is 4 blocks (256 KiB)
    k, v = (empty_pool((3, 16, block), torch.uint8) for _ in range(2))
    reported: list[int] = []

    def check(n: int) -> None:
        for t in (k, v):
            pages = resident_pages(t)
            per_block = block // mmap.PAGESIZE
            for row in range(3):
                first = row * 16 * per_block
                assert all(pages[first + 2 * per_block : first + n * per_block]), (row, n)
        reported.append(n)

    assert populate([k, v], range(2, 14), check)
    assert reported == [6, 10, 14]
    pages = resident_pages(k)
    per_block = block // mmap.PAGESIZE
    assert not any(pages[: 2 * per_block]) and not any(pages[14 * per_block : 16 * per_block])


def test_populate_in_background_ends_and_reports_the_last_block() -> None:
    reported: list[int] = []
    thread = populate_in_background([empty_pool((1, 8, 1 << 20), torch.uint8)], range(3, 8), reported.append)
    thread.join(timeout=60)
    assert not thread.is_alive() and reported[-1] == 8


def test_the_populating_thread_yields_every_core_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own thread only: the caller's threads keep their class."""
    policies: list[int] = []

    def recording(tensors: list[torch.Tensor], blocks: range, on_resident: object) -> bool:
        policies.append(os.sched_getscheduler(0))
        return True

    monkeypatch.setattr(host_memory, "populate", recording)
    before = os.sched_getscheduler(0)
    populate_in_background([empty_pool((1, 1, 4096), torch.uint8)], range(1)).join(timeout=60)
    assert policies == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == before


def test_where_the_idle_class_is_refused_the_thread_runs_at_nice_19(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seccomp profile may refuse SCHED_IDLE: the pool must still be faulted in, at the lowest priority."""
    seen: list[tuple[int, int]] = []

    def refuse(pid: int, policy: int, param: os.sched_param) -> None:
        raise PermissionError(1, "Operation not permitted")

    def recording(tensors: list[torch.Tensor], blocks: range, on_resident: object) -> bool:
        seen.append((os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return True

    monkeypatch.setattr(host_memory.os, "sched_setscheduler", refuse)
    monkeypatch.setattr(host_memory, "populate", recording)
    populate_in_background([empty_pool((1, 1, 4096), torch.uint8)], range(1)).join(timeout=60)
    assert seen == [(os.SCHED_OTHER, 19)]
