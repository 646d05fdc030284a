"""A server started with `--api-key`: /v1/* needs the key, the rest stays open; and SIGTERM ends the
streams in flight, then the server and its engine core process exit."""

from __future__ import annotations

import argparse
import json
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from llmserve.entrypoints.openai.server_args import add_server_args, server_args_from
from tests.entrypoints.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.remote_server import RemoteServer, alive, children

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def keyed_server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer([*SERVER_ARGS, "--api-key", KEY, "--tokenize-needs-api-key"])
    yield remote
    remote.stop()


def test_api_key_guards_v1_only(keyed_server: RemoteServer) -> None:
    with httpx.Client(base_url=keyed_server.url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = http.get("/v1/models", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        body = {"prompt": "x", "max_tokens": 1}
        assert http.post("/v1/completions", json=body).status_code == 401
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
        # open by default (the limited server's tests use it without a key), guarded with the flag
        guarded: list[tuple[str, dict[str, object]]] = [
            ("/tokenize", {"prompt": "x"}),
            ("/detokenize", {"tokens": [1]}),
        ]
        for path, body in guarded:
            assert http.post(path, json=body).status_code == 401
            assert http.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0) as client:
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    monkeypatch.setenv("LLMSERVE_API_KEY", "from-env")
    assert server_args_from(parser.parse_args([])).api_key == "from-env"
    assert server_args_from(parser.parse_args(["--api-key", "flag"])).api_key == "flag"
    monkeypatch.delenv("LLMSERVE_API_KEY")
    assert server_args_from(parser.parse_args([])).api_key is None


def test_sigterm_ends_streams_and_exits(keyed_server: RemoteServer) -> None:
    """Runs last: it stops the module's server."""
    subprocesses = children(keyed_server.proc.pid)
    assert subprocesses, "the engine core should run in a child process"
    body = {"model": MODEL, "prompt": "A long tale:", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with (
        httpx.Client(base_url=keyed_server.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body, headers=headers) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: {")
        keyed_server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert "shutting down" in error["message"]

    assert keyed_server.stop(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in subprocesses) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in subprocesses)
