"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from llmserve.model_executor.kernels import native


@pytest.fixture(params=native.supported_isas())
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each instruction-set build this CPU runs, forced in turn (an engine core inherits it)."""
    monkeypatch.setenv("LLMSERVE_CPU_ISA", request.param)
    assert native.load_library() is not None, "the C kernels must build here"
    return str(request.param)
