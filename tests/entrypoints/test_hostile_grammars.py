"""Grammars and heavy requests that once took the server down or stalled everyone, against a live
server: each hostile constraint is a 400 naming the field it came in, the server stays healthy and
answers as before; a light completion beside the heaviest requests finishes close to its time alone,
and the API process gives back what they made it hold."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.entrypoints.remote_server import RemoteServer
from tests.structured_output.test_limits import lark_chain, nested_schema_text, ref_chain

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
LIGHT = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def greedy_before(http: httpx.Client) -> str:
    response = http.post(CMPL, json=LIGHT)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def tool_body(schema: dict[str, Any]) -> dict[str, Any]:
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return {"messages": MESSAGES, "max_tokens": 4, "tools": [tool], "tool_choice": "required"}


def format_body(schema: dict[str, Any]) -> dict[str, Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {"messages": MESSAGES, "max_tokens": 4, "response_format": fmt}


CASES: list[tuple[str, Callable[[], dict[str, Any]], str]] = [
    *[
        (
            path,
            lambda n=n, base=base: {**base, "structured_outputs": {"json": ref_chain(n)}},
            "structured_outputs",
        )
        for n in (1_000, 10_000)
        for path, base in (
            (CMPL, {"prompt": "x", "max_tokens": 4}),
            (CHAT, {"messages": MESSAGES, "max_tokens": 4}),
        )
    ],
    *[
        (
            CMPL,
            lambda n=n: {"prompt": "x", "max_tokens": 4, "structured_outputs": {"grammar": lark_chain(n)}},
            "grammar",
        )
        for n in (3_000, 30_000)
    ],
    (
        CMPL,
        lambda: {"prompt": "x", "max_tokens": 4, "structured_outputs": {"json": nested_schema_text(2_000)}},
        "json",
    ),
    *[(CHAT, lambda n=n: format_body(ref_chain(n)), "response_format") for n in (1_000, 10_000)],
    *[(CHAT, lambda n=n: tool_body(ref_chain(n)), "tools") for n in (1_000, 10_000)],
]


@pytest.mark.parametrize(("path", "body", "field"), CASES)
def test_a_hostile_constraint_is_a_400_naming_its_field(
    http: httpx.Client, greedy_before: str, path: str, body: Callable[[], dict[str, Any]], field: str
) -> None:
    for stream in (False, True):
        response = http.post(path, json={**body(), "stream": stream})
        assert response.status_code == 400, response.text[:500]
        error = response.json()["error"]
        assert field in (error["param"] or ""), error
        assert "--max-grammar-" in error["message"], error
    assert http.get("/health").status_code == 200


def test_the_server_answers_as_before(http: httpx.Client, greedy_before: str) -> None:
    """Run after the hostile cases (pytest keeps the file's order)."""
    assert http.get("/health").status_code == 200
    assert http.post(CMPL, json=LIGHT).json()["choices"][0]["text"] == greedy_before


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def timed_light(http: httpx.Client) -> float:
    start = time.monotonic()
    assert http.post(CMPL, json=LIGHT).status_code == 200
    return time.monotonic() - start


def test_a_light_completion_beside_heavy_requests(
    server: RemoteServer, http: httpx.Client, greedy_before: str
) -> None:
    """Two 15 MB /tokenize calls, a 20,000-option regex and n=64 with a full-vocabulary logit_bias, all
    at once: a light completion started among them takes at most 3x its time beside a plain n=64
    request (the same compute in the batch, so what is measured is what the hostile parts add; a floor
    for a loaded two-core machine), and the API process's memory returns within 10%."""
    n64 = {"prompt": "Hello", "max_tokens": 8, "n": 64}
    timed_light(http)
    baseline = beside(server, http, [(CMPL, n64)])
    rss_before = rss_mib(server.proc.pid)
    huge = "word " * (3 << 20)  # 15 MB
    regex = "|".join(f"option{i}" for i in range(20_000))
    heavy: list[tuple[str, dict[str, Any]]] = [
        ("/tokenize", {"prompt": huge}),
        ("/tokenize", {"prompt": huge}),
        (CMPL, {"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": regex}}),
        (CMPL, {**n64, "logit_bias": {str(t): 0.5 for t in range(49_152)}}),
    ]
    hostile = beside(server, http, heavy)
    assert hostile <= max(3 * baseline, 5.0), (hostile, baseline)
    time.sleep(1.0)
    assert rss_mib(server.proc.pid) <= 1.10 * rss_before, (rss_mib(server.proc.pid), rss_before)


def beside(server: RemoteServer, http: httpx.Client, heavy: list[tuple[str, dict[str, Any]]]) -> float:
    """The light completion's time while `heavy` run; each of them is a 200, or a 400 for a body
    past the limits (the 15 MB prompts, the regex)."""
    statuses: list[int] = []

    def send(path: str, body: dict[str, Any]) -> None:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            content = json.dumps(body)
            response = client.post(path, content=content, headers={"Content-Type": "application/json"})
            statuses.append(response.status_code)

    workers = [threading.Thread(target=send, args=item) for item in heavy]
    for worker in workers:
        worker.start()
    time.sleep(0.5)  # the bodies are on their way or being served
    seconds = timed_light(http)
    for worker in workers:
        worker.join()
    assert set(statuses) <= {200, 400} and len(statuses) == len(heavy), statuses
    return seconds
