"""Overload control on a live server that runs one sequence at a time (`--max-num-seqs 1`), so that a
long request holds the engine while others queue: 503 + Retry-After past the queue limits and their
release on every path, the queue timeout, and priorities (refused under fcfs, ordering otherwise)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from tests.entrypoints.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.remote_server import RemoteServer

MAX_QUEUED_TOKENS = 100
QUEUE_TIME_S = 1.0
SHORT = "Say hi."  # a few tokens
LONG = "one two three four " * 30  # far more than MAX_QUEUED_TOKENS
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def priority_server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer(
        [
            *SERVER_ARGS,
            "--max-num-seqs",
            "1",
            "--scheduling-policy",
            "priority",
            "--max-num-queued-requests",
            "2",
            "--max-num-queued-tokens",
            str(MAX_QUEUED_TOKENS),
        ]
    )
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def fcfs_server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer([*SERVER_ARGS, "--max-num-seqs", "1", "--max-queue-time", str(QUEUE_TIME_S)])
    yield remote
    remote.stop()


def body(prompt: str = SHORT, max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


@asynccontextmanager
async def running(client: httpx.AsyncClient) -> AsyncIterator[None]:
    """A streamed request that holds the only sequence slot (its first token has come, so it is not
    queued) until the block ends, when its client leaves."""
    request = client.build_request(
        "POST", "/v1/completions", json=body(max_tokens=900, ignore_eos=True, stream=True)
    )
    response = await client.send(request, stream=True)
    try:
        assert response.status_code == 200
        lines = response.aiter_lines()  # held: an abandoned line iterator would close the connection
        while not (await anext(lines)).startswith("data: {"):
            pass
        yield
    finally:
        await response.aclose()


async def num_waiting(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("llmserve:num_requests_waiting{"))
    return float(line.rsplit(" ", 1)[1])


async def until_waiting(client: httpx.AsyncClient, count: int) -> None:
    """Until the engine core holds `count` waiting requests."""
    deadline = time.monotonic() + 30
    while await num_waiting(client) != count:
        assert time.monotonic() < deadline, f"never {count} waiting"
        await asyncio.sleep(0.05)


def assert_overloaded(response: httpx.Response, limit: str) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and error["type"] == "server_error"
    assert limit in error["message"]


async def stream_events(client: httpx.AsyncClient, payload: dict[str, Any]) -> list[str]:
    async with client.stream("POST", "/v1/completions", json={**payload, "stream": True}) as response:
        assert response.status_code == 200
        return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


async def fill_and_overflow(client: httpx.AsyncClient) -> list[asyncio.Task[httpx.Response]]:
    """Queues two short requests behind the running one, checking the token limit and then the
    request limit; returns the queued requests' tasks."""
    first = asyncio.create_task(client.post("/v1/completions", json=body()))
    await until_waiting(client, 1)
    assert_overloaded(await client.post("/v1/completions", json=body(LONG)), "max_num_queued_tokens")
    second = asyncio.create_task(client.post("/v1/completions", json=body()))
    await until_waiting(client, 2)
    assert_overloaded(await client.post("/v1/completions", json=body()), "max_num_queued_requests")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": SHORT}], "stream": True}
    assert_overloaded(await client.post("/v1/chat/completions", json=chat), "max_num_queued_requests")
    return [first, second]


async def test_queue_limits_answer_503_and_every_path_releases(priority_server: RemoteServer) -> None:
    async with httpx.AsyncClient(base_url=priority_server.url, timeout=60) as client:
        # Round one: the queued requests leave by every path but finishing: a client that goes away
        # (non-streamed), one that closes its stream before the first token.
        async with running(client):
            tasks = await fill_and_overflow(client)
            tasks[0].cancel()
            await asyncio.gather(tasks[0], return_exceptions=True)
            await until_waiting(client, 1)
            tasks[1].cancel()
            await asyncio.gather(tasks[1], return_exceptions=True)
            await until_waiting(client, 0)
            stream = client.build_request("POST", "/v1/completions", json=body(stream=True))
            response = await client.send(stream, stream=True)
            await until_waiting(client, 1)
            await response.aclose()
            await until_waiting(client, 0)
        # Round two: the same limits hold exactly, so nothing leaked; these finish normally.
        async with running(client):
            tasks = await fill_and_overflow(client)
        for response in await asyncio.gather(*tasks):
            assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
        # Round three: every count is back to zero after finishing too.
        async with running(client):
            tasks = await fill_and_overflow(client)
        await asyncio.gather(*tasks)


async def test_higher_priority_overtakes_an_earlier_request(priority_server: RemoteServer) -> None:
    async with httpx.AsyncClient(base_url=priority_server.url, timeout=60) as client:
        finished: list[str] = []

        async def complete(name: str, priority: int) -> None:
            response = await client.post("/v1/completions", json=body(priority=priority))
            assert response.status_code == 200, response.text
            finished.append(name)

        async with running(client):
            low = asyncio.create_task(complete("low", 10))
            await until_waiting(client, 1)
            high = asyncio.create_task(complete("high", -10))
            await until_waiting(client, 2)
        await asyncio.gather(low, high)
        assert finished == ["high", "low"]


async def test_fcfs_refuses_a_priority(fcfs_server: RemoteServer) -> None:
    async with httpx.AsyncClient(base_url=fcfs_server.url, timeout=60) as client:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": SHORT}], "max_tokens": 2}
        for path, payload in (("/v1/completions", body()), ("/v1/chat/completions", chat)):
            for stream in (False, True):
                response = await client.post(path, json={**payload, "stream": stream, "priority": 3})
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == "priority"
            assert (await client.post(path, json={**payload, "priority": 0})).status_code == 200
        response = await client.post("/v1/completions", json=body(priority=True))
        assert response.status_code == 400 and response.json()["error"]["param"] == "priority"


async def test_queue_timeout_ends_waiting_requests_with_an_error(fcfs_server: RemoteServer) -> None:
    async with httpx.AsyncClient(base_url=fcfs_server.url, timeout=60) as client:
        async with running(client):
            started = time.monotonic()
            response = await client.post("/v1/completions", json=body())
            assert time.monotonic() - started >= QUEUE_TIME_S
            assert_overloaded(response, "max_queue_time")
            events = await stream_events(client, body())
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert set(error) == ERROR_FIELDS and "max_queue_time" in error["message"]
            assert error["code"] == "server_overloaded"
            assert await num_waiting(client) == 0
        response = await client.post("/v1/completions", json=body())
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
