"""The real default model, loaded once per session by us (tests/conftest.py's hf_model is Hugging Face's
reference); and the path of Gemma 3 270M."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve import LLM
from llmserve.model_executor.loader import resolve_model

# Fixed prompts of mixed lengths and kinds (prose, code, a list, chat-formatted, numbers).
PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "<|im_start|>user\nWhat are three good habits for staying healthy?<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 5, 8, 13,",
    "The theory of general relativity, published by Albert Einstein in 1915, describes gravity as",
    "Here is a list of fruits:\n- apple\n- banana\n-",
    "Q: Why is the sky blue?\nA:",
]


@pytest.fixture(scope="session")
def llm() -> Iterator[LLM]:
    engine = LLM(kv_cache_memory=512 << 20, max_num_seqs=128, dtype="float32")  # HF reference: fp32
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def gemma_gguf_path() -> Path:
    """Gemma 3 270M Q4_K_M, joined into the models cache from the packages that `make install` adds;
    fails rather than skips without them, since the install step provides them."""
    try:
        return resolve_model("gemma-3-270m").path
    except ValueError as e:
        pytest.fail(str(e))
