"""A server started with `--served-model-name`: its engine core process logs its start-up lines; the
server answers to that name only, as vLLM does; while the core process is stopped, /health turns 503 and
turns 200 again once it resumes; and when the core process dies, /health turns 503, requests get
OpenAI's error body at once, never a hang, and the gauges drop to zero."""

from __future__ import annotations

import argparse
import json
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

from llmserve.engine.core_launcher import PROCESS_TITLE
from llmserve.entrypoints.openai.server_args import ServerArgs, add_server_args, server_args_from
from llmserve.model_executor.kernels import native
from tests.entrypoints.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.remote_server import RemoteServer, children

NAME = "my-served-name"
ERROR_FIELDS = {"message", "type", "param", "code"}
HEARTBEAT_TIMEOUT_S = 2.0
RUNNING = re.compile(rf'^llmserve:num_requests_running\{{engine="0",model_name="{NAME}"\}} (\S+)$', re.M)


@pytest.fixture(scope="module")
def named_server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer(
        [*SERVER_ARGS, "--served-model-name", NAME, "--engine-heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]
    )
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


def test_engine_heartbeat_timeout_flag() -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_args_from(parser.parse_args([])).engine_heartbeat_timeout == 20.0
    flag = parser.parse_args(["--engine-heartbeat-timeout", "2.5"])
    assert server_args_from(flag).engine_heartbeat_timeout == 2.5
    for bad in (0.0, -1.0, 0.5, float("nan")):
        with pytest.raises(ValueError, match="engine_heartbeat_timeout must be at least 1 s"):
            ServerArgs(engine_heartbeat_timeout=bad)


def poll_health(http: httpx.Client, status: int, within: float) -> httpx.Response:
    """/health, asked until it answers `status` or `within` seconds have passed."""
    deadline = time.monotonic() + within
    while (health := http.get("/health")).status_code != status and time.monotonic() < deadline:
        time.sleep(0.1)
    return health


def completion_stream(http: httpx.Client, max_tokens: int) -> Iterator[dict[str, Any]]:
    """A streamed completion's chunks, as they come."""
    body = {"model": NAME, "prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line.removeprefix("data: "))


def test_health_is_503_while_the_engine_core_is_stopped_and_200_once_it_resumes(
    named_server: RemoteServer,
) -> None:
    """A stopped core (an attacker's SIGSTOP, a wedged kernel) neither exits nor answers: its requests
    wait with no error, so /health must say so within the heartbeat timeout, and take it back once the
    core resumes, whose waiting request then completes."""
    core = engine_core_pid(named_server)
    with httpx.Client(base_url=named_server.url, timeout=30) as http:
        chunks = completion_stream(http, 64)
        text = next(chunks)["choices"][0]["text"]
        assert http.get("/health").status_code == 200  # computing: alive
        os.kill(core, signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            health = poll_health(http, 503, HEARTBEAT_TIMEOUT_S + 3)
            assert health.status_code == 503, "a stopped core must not look healthy"
            assert time.monotonic() - stopped_at > HEARTBEAT_TIMEOUT_S / 2  # not before its time
            error = health.json()["error"]
            assert set(error) == ERROR_FIELDS and "stopped or hung" in error["message"]
        finally:
            os.kill(core, signal.SIGCONT)
        assert poll_health(http, 200, 5).status_code == 200
        finish_reason = None
        for chunk in chunks:
            text += chunk["choices"][0]["text"]
            finish_reason = chunk["choices"][0]["finish_reason"] or finish_reason
        assert finish_reason == "length" and text


def running_requests(http: httpx.Client) -> float:
    match = RUNNING.search(http.get("/metrics").text)
    assert match, "no running-requests gauge"
    return float(match.group(1))


def test_health_is_503_once_the_engine_core_is_killed(named_server: RemoteServer) -> None:
    """Runs last: it kills the module's engine core, while a request runs, whose gauge must then drop to 0
    (a dead core holds nothing; a router must not see its last load)."""
    with httpx.Client(base_url=named_server.url, timeout=10) as http:  # a hang fails as a timeout
        running = completion_stream(http, 512)
        next(running)
        assert running_requests(http) == 1
        os.kill(engine_core_pid(named_server), signal.SIGKILL)
        assert list(running)  # ended (with an error event), never a hang
        deadline = time.monotonic() + 5
        while (health := http.get("/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health.status_code == 503
        assert set(health.json()["error"]) == ERROR_FIELDS
        assert running_requests(http) == 0
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
