"""llmserve: run and serve large language models.

The public names are imported lazily, so that the engine core process (which imports
`llmserve.engine.core_proc`) does not pay for the front end's imports (transformers, tokenizers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "llmserve.entrypoints.llm",
    "AsyncLLM": "llmserve.engine.async_llm",
    "SamplingParams": "llmserve.sampling_params",
    "RequestOutputKind": "llmserve.sampling_params",
    "RequestOutput": "llmserve.outputs",
    "CompletionOutput": "llmserve.outputs",
    "PoolingParams": "llmserve.pooling_params",
    "PoolingRequestOutput": "llmserve.outputs",
    "EmbeddingRequestOutput": "llmserve.outputs",
}
__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "EmbeddingRequestOutput",
]

if TYPE_CHECKING:
    from llmserve.engine.async_llm import AsyncLLM
    from llmserve.entrypoints.llm import LLM
    from llmserve.outputs import CompletionOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
    from llmserve.pooling_params import PoolingParams
    from llmserve.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
