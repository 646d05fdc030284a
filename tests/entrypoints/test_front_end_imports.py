"""The API server's process is a front end: the model, and with it torch and our C kernels, live in the
engine core's process. Importing them here would cost the server start-up time and hundreds of MiB of
memory it never uses, so each front-end entry point is imported in a fresh interpreter and checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "llmserve.model_executor.kernels.native")


@pytest.mark.parametrize(
    "statement",
    [
        "import llmserve.entrypoints.openai.api_server",
        "import llmserve.entrypoints.cli",  # `llmserve serve`
        "from llmserve import LLM, AsyncLLM, SamplingParams",  # their cores run in another process
    ],
)
def test_the_front_end_imports_neither_torch_nor_the_kernels(statement: str) -> None:
    check = f"{statement}; import sys; print([m for m in {HEAVY!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"{statement} imported {result.stdout.strip()}"
