"""The instruction-set builds the kernel tests run: each one this CPU runs, or with LLMSERVE_TEST_ONE_ISA
(`make test-fast`, the inner loop) the best alone."""

from __future__ import annotations

import os

from llmserve.model_executor.kernels import native

_SUPPORTED = native.supported_isas()
TESTED_ISAS = _SUPPORTED[:1] if os.environ.get("LLMSERVE_TEST_ONE_ISA") else _SUPPORTED
