"""vllm-router (PyPI `vllm-router`, in the clients' venv) in front of two `llmserve serve` replicas on
loopback, as users run it in front of vLLM replicas: a load of completions and chat completions
(plain and streamed) through the router all succeed and reach both replicas, as each replica's own
/metrics counts; a killed replica is reported by the router's /health and the load goes on on the
other. The router adds SGLang's fields to every body it forwards; the server accepts them at their
defaults (protocol.py's `harmless`)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tests.entrypoints.conftest import MODEL
from tests.entrypoints.remote_server import RemoteServer, alive, children, free_port

ROUTER = Path(__file__).resolve().parents[2] / ".venv-clients" / "bin" / "vllm-router"
REPLICA_ARGS = ["--kv-cache-memory", str(64 << 20), "--num-threads", "1", "--max-model-len", "512",
                "--disable-log-stats"]  # fmt: skip
COMPLETIONS = 16
CONCURRENCY = 8
MAX_TOKENS = 8
# The router checks every worker's /health each second and drops it after one failure.
ROUTER_HEALTH_ARGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                      "--health-check-timeout-secs", "2", "--worker-startup-check-interval", "1"]  # fmt: skip
READY_TIMEOUT_S = 30.0


class Router:
    """`vllm-router` with round-robin routing over `workers`; waits until it answers /health."""

    def __init__(self, workers: list[str]) -> None:
        if not ROUTER.is_file():
            pytest.fail(f"{ROUTER} is missing: `make clients` (part of `make test`) installs vllm-router.")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-router-", suffix=".log")  # noqa: SIM115 (closed in stop)
        address = ["--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(free_port())]
        routing = ["--worker-urls", *workers, "--policy", "round_robin", *ROUTER_HEALTH_ARGS]
        command = [str(ROUTER), *address, *routing]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.output()
                self.stop()
                pytest.fail(f"vllm-router did not start:\n{output}")
            time.sleep(0.1)

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def output(self) -> str:
        return Path(self.log.name).read_text()[-5000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def replicas(default_model_path: object) -> Iterator[list[RemoteServer]]:
    """Two replicas, started side by side."""
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(RemoteServer, REPLICA_ARGS) for _ in range(2)]
    started = [f.result() for f in futures if f.exception() is None]
    failure = next((error for f in futures if (error := f.exception()) is not None), None)
    if failure is not None:
        for server in started:
            server.stop()
        raise failure
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def router(replicas: list[RemoteServer]) -> Iterator[Router]:
    running = Router([server.url for server in replicas])
    yield running
    running.stop()


def finished(server: RemoteServer) -> dict[str, float]:
    """The replica's finished requests, summed over ranks and finish reasons, under our name and
    vLLM's (which routers read)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    totals = {"llmserve:request_success": 0.0, "vllm:request_success": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals


async def send_load(url: str) -> None:
    """`COMPLETIONS` completions, `CONCURRENCY` at a time, then a chat completion and a streamed one;
    every one must succeed with generated text."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    limit = asyncio.Semaphore(CONCURRENCY)

    async def complete(i: int) -> None:
        async with limit:
            done = await client.completions.create(
                model=MODEL,
                prompt=f"Request {i}: the numbers after {i} are",
                max_tokens=MAX_TOKENS,
                temperature=0,
            )
        assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens >= 1

    async with client:
        await asyncio.gather(*(complete(i) for i in range(COMPLETIONS)))
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": "Say hi."}
        ]
        chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS)
        assert chat.choices[0].message.content
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_the_routers_fields_are_accepted_at_their_defaults_only() -> None:
    """What the router adds to a body (captured from 0.1.17) passes; a value that would change the
    output is refused, naming the field, as every unimplemented field is."""
    prompt = {"model": MODEL, "prompt": "hi", "echo": False, "ignore_eos": False, "skip_special_tokens": True}
    CompletionRequest.model_validate({**prompt, "no_stop_trim": False, "return_hidden_states": False})
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": False,
            "continue_final_message": False, "no_stop_trim": False, "return_hidden_states": False,
            "include_reasoning": True, "separate_reasoning": True, "stream_reasoning": True}  # fmt: skip
    ChatCompletionRequest.model_validate(chat)
    with pytest.raises(ValueError, match="no_stop_trim is not supported"):
        CompletionRequest.model_validate({**prompt, "no_stop_trim": True})
    with pytest.raises(ValueError, match="separate_reasoning is not supported"):
        ChatCompletionRequest.model_validate({**chat, "separate_reasoning": False})


async def test_a_load_through_the_router_reaches_both_replicas(
    router: Router, replicas: list[RemoteServer]
) -> None:
    before = [finished(server) for server in replicas]
    models = httpx.get(f"{router.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]

    await send_load(router.url)

    served = []
    for server, was in zip(replicas, before, strict=True):
        now = finished(server)
        assert now["vllm:request_success"] == now["llmserve:request_success"]
        served.append(now["llmserve:request_success"] - was["llmserve:request_success"])
    assert sum(served) == COMPLETIONS + 2, served
    assert min(served) >= 1, f"one replica served nothing: {served}"


async def test_a_killed_replica_is_reported_and_the_load_goes_to_the_other(
    router: Router, replicas: list[RemoteServer]
) -> None:
    survivor, victim = replicas
    core_pids = children(victim.proc.pid)
    victim.proc.kill()
    deadline = time.monotonic() + 10
    while (health := httpx.get(f"{router.url}/health", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "the router still reports every worker healthy"
        await asyncio.sleep(0.2)
    assert health.status_code == 503 and victim.url in health.text and survivor.url not in health.text

    was = finished(survivor)["llmserve:request_success"]
    await send_load(router.url)
    assert finished(survivor)["llmserve:request_success"] - was == COMPLETIONS + 2

    victim.proc.wait(10)
    deadline = time.monotonic() + 10  # the engine core exits when its parent dies
    while any(alive(pid) for pid in core_pids):
        assert time.monotonic() < deadline, "the killed replica's engine core outlived it"
        await asyncio.sleep(0.2)
