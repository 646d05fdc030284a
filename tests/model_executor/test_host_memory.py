"""The KV pool's host memory: an ordinary tensor to its users, made resident without losing a write."""

from __future__ import annotations

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


def test_populate_makes_the_pool_resident_and_keeps_what_was_written() -> None:
    t = empty_pool((64 << 20,), torch.uint8)
    t[:3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
    small = torch.full((100,), 5, dtype=torch.uint8)  # malloc'd, not page-aligned
    before = resident_bytes()
    assert populate([t, small])
    assert resident_bytes() - before >= 60 << 20
    assert t[:3].tolist() == [7, 8, 9] and small.sum().item() == 500


def test_populate_in_background_ends() -> None:
    thread = populate_in_background([empty_pool((8 << 20,), torch.uint8)])
    thread.join(timeout=60)
    assert not thread.is_alive()


def test_the_populating_thread_yields_every_core_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own thread only: the caller's threads keep their class."""
    policies: list[int] = []

    def recording(tensors: list[torch.Tensor]) -> bool:
        policies.append(os.sched_getscheduler(0))
        return True

    monkeypatch.setattr(host_memory, "populate", recording)
    before = os.sched_getscheduler(0)
    populate_in_background([empty_pool((4096,), torch.uint8)]).join(timeout=60)
    assert policies == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == before


def test_where_the_idle_class_is_refused_the_thread_runs_at_nice_19(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seccomp profile may refuse SCHED_IDLE: the pool must still be faulted in, at the lowest priority."""
    seen: list[tuple[int, int]] = []

    def refuse(pid: int, policy: int, param: os.sched_param) -> None:
        raise PermissionError(1, "Operation not permitted")

    def recording(tensors: list[torch.Tensor]) -> bool:
        seen.append((os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return True

    monkeypatch.setattr(host_memory.os, "sched_setscheduler", refuse)
    monkeypatch.setattr(host_memory, "populate", recording)
    populate_in_background([empty_pool((4096,), torch.uint8)]).join(timeout=60)
    assert seen == [(os.SCHED_OTHER, 19)]
