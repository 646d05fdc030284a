"""SmolLM2's tokenizer and an llguidance backend over it (built once: ~1 s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmserve.model_executor.loader import resolve_model
from llmserve.model_executor.loader.tokenizer import eos_token_ids, load_tokenizer
from llmserve.structured_output.llguidance_backend import LLGuidanceBackend

VOCAB_SIZE = 49152  # SmolLM2's logits


@pytest.fixture(scope="session")
def tokenizer(default_model_path: Path) -> Any:
    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def backend(tokenizer: Any) -> LLGuidanceBackend:
    return LLGuidanceBackend(
        tokenizer, VOCAB_SIZE, eos_token_ids(resolve_model("smollm2-135m-instruct"), tokenizer)
    )
