"""The server's tests share one real server per module (the default model, a small KV pool)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from transformers import PreTrainedTokenizerBase

from llmserve.model_executor.loader import load_tokenizer, resolve_model
from tests.entrypoints.remote_server import RemoteServer

MODEL = "smollm2-135m-instruct"
# Small enough for a quick start and an over-long prompt that is cheap to send.
SERVER_ARGS = ["--kv-cache-memory", str(256 << 20), "--max-model-len", "1024", "--disable-log-stats"]


@pytest.fixture(scope="module")
def server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer(SERVER_ARGS)
    yield remote
    remote.stop()


@pytest.fixture(scope="session")
def tokenizer(default_model_path: object) -> PreTrainedTokenizerBase:
    """The model's tokenizer, loaded here: usage counts are checked against it."""
    return load_tokenizer(resolve_model(MODEL))
