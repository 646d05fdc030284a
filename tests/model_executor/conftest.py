"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from llmserve.model_executor.kernels import native
from tests.model_executor.isas import TESTED_ISAS


@pytest.fixture(params=TESTED_ISAS)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each tested instruction-set build (`isas.py`), forced in turn (an engine core inherits it)."""
    monkeypatch.setenv("LLMSERVE_CPU_ISA", request.param)
    assert native.load_library() is not None, "the C kernels must build here"
    return str(request.param)
