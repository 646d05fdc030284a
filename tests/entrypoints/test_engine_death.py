"""A server started with `--served-model-name`: its engine core process logs its start-up lines; the
server answers to that name only, as vLLM does; and when the core process dies, /health turns 503 and
requests get OpenAI's error body at once, never a hang."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from llmserve.engine.core_proc import PROCESS_TITLE
from llmserve.model_executor.kernels import native
from tests.entrypoints.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.remote_server import RemoteServer, children

NAME = "my-served-name"
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def named_server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer([*SERVER_ARGS, "--served-model-name", NAME])
    yield remote
    remote.stop(timeout=30)  # a server whose engine died still exits on SIGTERM


def engine_core_pid(server: RemoteServer) -> int:
    """The server's child process that runs the engine core, known by the title it gives itself."""
    cores = [
        pid
        for pid in children(server.proc.pid)
        if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(PROCESS_TITLE.encode())
    ]
    assert len(cores) == 1, f"one engine core process expected among {children(server.proc.pid)}"
    return cores[0]


def test_the_engine_core_process_logs_its_memory_and_kernel_build(named_server: RemoteServer) -> None:
    """The core runs in a spawned process, which starts with logging unconfigured: its start-up lines
    must still reach the server's output. (Their numbers: tests/engine/test_startup_log.py.)"""
    log = named_server.output()
    assert f"llmserve.model_executor.kernels.native: Native kernels: {native.selected_isa()} build." in log
    assert "llmserve.engine.core: Model weights take " in log
    assert re.search(
        r"llmserve\.engine\.core: KV cache: [\d.]+ GiB, \d+ blocks of 16 tokens \(\d+ tokens\), float32\.",
        log,
    )
    assert "llmserve.engine.core: Maximum concurrency for 1024 tokens per request: " in log


def test_served_model_name_is_the_only_name(named_server: RemoteServer) -> None:
    with httpx.Client(base_url=named_server.url, timeout=60) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [NAME]
        assert http.get(f"/v1/models/{NAME}").json()["id"] == NAME
        body = {"prompt": "Hi", "max_tokens": 1}
        for model in (NAME, None):  # no model: the served name
            answer = http.post("/v1/completions", json={**body, "model": model})
            assert answer.status_code == 200 and answer.json()["model"] == NAME, answer.text
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        for wrong, name in (
            (http.post("/v1/completions", json={**body, "model": MODEL}), MODEL),  # the model path is no name
            (http.post("/v1/chat/completions", json={**chat, "model": "nope"}), "nope"),
            (http.get(f"/v1/models/{MODEL}"), MODEL),
        ):
            assert wrong.status_code == 404, wrong.text
            error = wrong.json()["error"]
            assert (
                set(error) == ERROR_FIELDS and error["code"] == "model_not_found" and name in error["message"]
            )
        assert f'model_name="{NAME}"' in http.get("/metrics").text

    with openai.OpenAI(base_url=f"{named_server.url}/v1", api_key="unused", max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": "Hi"}]
        assert client.chat.completions.create(model=NAME, messages=messages, max_tokens=1).model == NAME
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_health_is_503_once_the_engine_core_is_killed(named_server: RemoteServer) -> None:
    """Runs last: it kills the module's engine core."""
    os.kill(engine_core_pid(named_server), signal.SIGKILL)
    with httpx.Client(base_url=named_server.url, timeout=10) as http:  # a hang fails as a timeout
        deadline = time.monotonic() + 5
        while (health := http.get("/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health.status_code == 503
        assert set(health.json()["error"]) == ERROR_FIELDS
        chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
        for path, body in (
            ("/v1/completions", {"model": NAME, "prompt": "Hi", "max_tokens": 4}),
            ("/v1/chat/completions", chat),
        ):
            answer = http.post(path, json=body)
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert set(error) == ERROR_FIELDS and error["type"] == "server_error" and error["message"]
    assert named_server.proc.poll() is None, "the front end stays up to answer 503s"
