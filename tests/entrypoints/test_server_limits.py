"""What one client can make the server hold or wait for, tested on a live server over raw sockets: an
oversized body is refused (413) before it is read, a body or a request head that never completes is cut
off, a long tokenization leaves /health answering; and the API key's scheme and encoding, and a 500
that hides the exception's text."""

from __future__ import annotations

import json
import logging
import re
import select
import socket
import threading
import time
from collections.abc import Iterable, Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from transformers import PreTrainedTokenizerBase

from llmserve.entrypoints.openai.errors import install_error_handlers
from llmserve.entrypoints.openai.streaming import error_event
from tests.entrypoints.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.remote_server import RemoteServer

KEY = "clé"  # not ASCII: valid in a header as Latin-1 or UTF-8 bytes
BODY_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 2.0
BODY_LIMIT = 8 << 20
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def limited_server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer(
        [
            *SERVER_ARGS,
            "--api-key",
            KEY,
            "--max-request-body-bytes",
            str(BODY_LIMIT),
            "--request-body-timeout",
            str(BODY_TIMEOUT_S),
            "--request-header-timeout",
            str(HEADER_TIMEOUT_S),
        ]
    )
    yield remote
    remote.stop()


def exchange(port: int, head: bytes, body: Iterable[bytes] = (), wait_s: float = 30.0) -> bytes:
    """Sends `head`, then the chunks of `body` until the server answers; returns all the server sent
    before it closed the connection (or `wait_s` passed)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        for chunk in body:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        received = b""
        deadline = time.monotonic() + wait_s
        sock.settimeout(wait_s)
        while time.monotonic() < deadline:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            received += data
        return received


def status_and_error(raw: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    error = json.loads(body)["error"]
    assert set(error) == ERROR_FIELDS
    return status, error


def post_head(path: str, extra: str) -> bytes:
    auth = f"Authorization: Bearer {KEY}\r\n"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}{extra}\r\n".encode()


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
def test_declared_oversized_body_is_refused_unread(limited_server: RemoteServer, path: str) -> None:
    size = 50_000_000
    start = time.monotonic()
    raw = exchange(
        limited_server.port, post_head(path, f"Content-Length: {size}\r\n"), [b" " * (1 << 20)] * 50
    )
    status, error = status_and_error(raw)
    assert status == 413
    assert error["code"] == "request_too_large"
    assert time.monotonic() - start < 10


def test_chunked_oversized_body_is_refused_at_the_limit(limited_server: RemoteServer) -> None:
    chunk = b" " * (1 << 20)
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    raw = exchange(
        limited_server.port, post_head("/tokenize", "Transfer-Encoding: chunked\r\n"), [framed] * 50
    )
    status, error = status_and_error(raw)
    assert status == 413
    assert str(BODY_LIMIT) in str(error["message"])


def test_body_that_never_completes_gets_408(limited_server: RemoteServer) -> None:
    start = time.monotonic()
    raw = exchange(limited_server.port, post_head("/tokenize", "Content-Length: 100\r\n") + b'{"prompt": ')
    status, error = status_and_error(raw)
    assert status == 408
    assert error["code"] == "request_timeout"
    assert BODY_TIMEOUT_S - 0.5 < time.monotonic() - start < BODY_TIMEOUT_S + 5


@pytest.mark.parametrize("partial", [b"", b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Len"])
def test_head_that_never_completes_is_closed(limited_server: RemoteServer, partial: bytes) -> None:
    start = time.monotonic()
    assert exchange(limited_server.port, partial) == b""
    assert HEADER_TIMEOUT_S - 0.5 < time.monotonic() - start < HEADER_TIMEOUT_S + 5


def test_allowed_body_is_read(limited_server: RemoteServer) -> None:
    """A 2 MB body, under the limit, is read and answered by the route: this prompt cannot fit
    max_model_len, so /tokenize refuses it by its length, as generation would, without tokenizing."""
    with httpx.Client(base_url=limited_server.url, timeout=60) as http:
        prompt = "word " * 400_000
        response = http.post("/tokenize", json={"prompt": prompt})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "prompt"
        assert http.post("/detokenize", json={"tokens": [1] * 1025}).json()["error"]["param"] == "tokens"


def test_idle_keep_alive_outlives_the_head_timeout(limited_server: RemoteServer) -> None:
    """Between requests only uvicorn's keep-alive (5 s) applies, not the head timeout."""
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", limited_server.port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(request)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(HEADER_TIMEOUT_S + 1)


def test_health_answers_while_a_long_prompt_is_tokenized(limited_server: RemoteServer) -> None:
    """A prompt truncated to its last tokens is tokenized whole first (its length alone refuses nothing)."""
    prompt = ("The quick brown fox jumps over the lazy dog. " * 100_000)[: 4 << 20]  # ~1M tokens, seconds
    result: dict[str, float | int] = {}

    def tokenize() -> None:
        start = time.monotonic()
        body = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 8}
        with httpx.Client(
            base_url=limited_server.url, timeout=120, headers={b"Authorization": f"Bearer {KEY}".encode()}
        ) as http:
            result["status"] = http.post("/v1/completions", json=body).status_code
        result["seconds"] = time.monotonic() - start

    worker = threading.Thread(target=tokenize)
    worker.start()
    latencies: list[float] = []
    with httpx.Client(base_url=limited_server.url, timeout=30) as http:
        time.sleep(0.3)  # the body is sent and tokenizing
        while worker.is_alive():
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.1)
    worker.join()
    assert result["status"] == 200
    assert result["seconds"] > 1.5, "the prompt should take long enough to tokenize to show anything"
    assert len(latencies) >= 5
    assert max(latencies) < 0.5, latencies


def test_far_too_long_prompt_is_refused_before_tokenizing(limited_server: RemoteServer) -> None:
    """4 MB would take seconds to tokenize; its length alone shows it cannot fit."""
    body = {"model": MODEL, "prompt": "word " * 800_000, "max_tokens": 1}
    with httpx.Client(base_url=limited_server.url, timeout=60) as http:
        start = time.monotonic()
        response = http.post(
            "/v1/completions", json=body, headers={b"Authorization": f"Bearer {KEY}".encode()}
        )
        elapsed = time.monotonic() - start
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert "characters long" in error["message"]
    assert elapsed < 1.5


def test_prompt_at_the_token_limit_is_not_refused_by_its_length(
    limited_server: RemoteServer, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The vocabulary's longest entry, repeated max_model_len times: the most characters that can fit,
    which the character bound must leave to the tokenizer (that then counts the tokens exactly)."""
    vocab = tokenizer.get_vocab()
    longest = str(tokenizer.decode([vocab[max(vocab, key=len)]]))
    body = {"model": MODEL, "prompt": longest * 1024, "max_tokens": 1}
    with httpx.Client(base_url=limited_server.url, timeout=120) as http:
        response = http.post(
            "/v1/completions", json=body, headers={b"Authorization": f"Bearer {KEY}".encode()}
        )
    assert response.status_code == 400
    assert "tokens long" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "value",
    [
        b"bearer " + KEY.encode("utf-8"),
        b"BEARER " + KEY.encode("latin-1"),
        b"Bearer  " + KEY.encode("utf-8"),
    ],
)
def test_api_key_scheme_and_encoding(limited_server: RemoteServer, value: bytes) -> None:
    with httpx.Client(base_url=limited_server.url, timeout=30) as http:
        assert http.get("/v1/models", headers={b"Authorization": value}).status_code == 200


@pytest.mark.parametrize("value", [b"Bearer cle", b"Basic " + KEY.encode(), KEY.encode(), b"Bearer"])
def test_wrong_api_key_is_refused(limited_server: RemoteServer, value: bytes) -> None:
    with httpx.Client(base_url=limited_server.url, timeout=30) as http:
        response = http.get("/v1/models", headers={b"Authorization": value})
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_completion_with_lower_case_scheme(limited_server: RemoteServer) -> None:
    with httpx.Client(base_url=limited_server.url, timeout=60) as http:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        response = http.post(
            "/v1/completions", json=body, headers={b"Authorization": f"bearer {KEY}".encode()}
        )
        assert response.status_code == 200
        assert response.json()["choices"]


@pytest.mark.parametrize("kind", [RuntimeError, RecursionError, MemoryError])
def test_internal_error_hides_the_exception(caplog: pytest.LogCaptureFixture, kind: type[Exception]) -> None:
    """A handler's unexpected exception: the client gets a request id, the log gets the traceback once
    (not re-raised for the server to log again)."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom() -> None:
        raise kind("secret path /home/alice/key.txt")

    with (
        caplog.at_level(logging.ERROR),
        TestClient(app, raise_server_exceptions=True) as c,
    ):
        response = c.get("/boom")
    assert response.status_code == 500
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS
    assert error["type"] == "server_error"
    assert "secret" not in error["message"]
    match = re.fullmatch(r"Internal server error \(request id (req-[0-9a-f]{32})\)\.", error["message"])
    assert match, error["message"]
    logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert "secret path" in str(logged[0].exc_info[1])
    assert [r for r in caplog.records if r.exc_info] == logged[:1]

    event = error_event(RuntimeError("secret in a stream"))
    assert "secret" not in event and "request id req-" in event
