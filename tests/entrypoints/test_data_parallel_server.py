"""`llmserve serve --data-parallel-size 2`: a load reaches both ranks and succeeds; `X-data-parallel-rank`
/metrics reports each rank; a killed rank fails its own requests, turns /health 503 naming it, and the
other rank serves on."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmserve.engine.core_launcher import PROCESS_TITLE
from tests.entrypoints.conftest import SERVER_ARGS
from tests.entrypoints.remote_server import RemoteServer

DP_ARGS = [*SERVER_ARGS, "--data-parallel-size", "2", "--num-threads", "1"]
PROMPTS = [f"Count from {i} to {i + 5}:" for i in range(8)]


def pids_titled(title: bytes) -> list[int]:
    """Processes whose title (their command line's first word) starts with `title`, wherever they run:
    the server's children, or Ray's workers."""
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _cmdline(p).split(b"\0")[0].startswith(title)
    ]


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def prompt_tokens_by_rank(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    found = re.findall(r"^llmserve:prompt_tokens_total\{(.*?)\} (\S+)$", text, re.M)
    out: dict[str, float] = {}
    for labels, value in found:
        engine = re.search(r'engine="(\w+)"', labels)
        assert engine is not None, labels
        out[engine.group(1)] = float(value)
    return out


def complete(
    http: httpx.Client, prompt: str, headers: dict[str, str | bytes] | None = None
) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    # httpx takes a bytes value under a str name (test_the_header_pins_a_rank sends one); its types do not
    return http.post("/v1/completions", json=body, headers=headers or {})  # type: ignore[arg-type]


def check_load_reaches_both_ranks(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = prompt_tokens_by_rank(http)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda p: complete(http, p), PROMPTS))
        assert [r.status_code for r in responses] == [200] * len(PROMPTS), responses[0].text
        assert all(r.json()["choices"][0]["text"] for r in responses)
        after = prompt_tokens_by_rank(http)
        for rank in ("0", "1"):
            assert after[rank] > before.get(rank, 0.0), (before, after)


def check_a_killed_rank_is_reported(server: RemoteServer, pid: int) -> None:
    """SIGKILL the rank that runs as `pid`; /health names it, requests pinned to it fail, the rest work."""
    os.kill(pid, signal.SIGKILL)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        deadline = time.monotonic() + 30
        while (health := http.get("/health")).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert health.status_code == 503
        died = re.search(r"Data-parallel rank (\d) died", health.json()["error"]["message"])
        assert died is not None, health.text
        rank = died.group(1)
        pinned = complete(http, PROMPTS[0], {"X-data-parallel-rank": rank})
        assert pinned.status_code == 503 and f"rank {rank} is dead" in pinned.json()["error"]["message"]
        assert [complete(http, p).status_code for p in PROMPTS[:4]] == [200] * 4
        # a dead rank holds nothing: a router must not read its last load
        metrics = http.get("/metrics").text
        assert re.search(rf'^vllm:num_requests_running\{{[^}}]*engine="{rank}"[^}}]*\}} 0\.0$', metrics, re.M)


@pytest.fixture(scope="module")
def dp_server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer(DP_ARGS)
    yield remote
    remote.stop(timeout=30)


def test_a_load_reaches_both_ranks(dp_server: RemoteServer) -> None:
    check_load_reaches_both_ranks(dp_server)


def test_the_header_pins_a_rank(dp_server: RemoteServer) -> None:
    with httpx.Client(base_url=dp_server.url, timeout=60) as http:
        before = prompt_tokens_by_rank(http)
        for _ in range(3):
            assert complete(http, PROMPTS[1], {"X-data-parallel-rank": "1"}).status_code == 200
        after = prompt_tokens_by_rank(http)
        assert after["0"] == before["0"] and after["1"] > before["1"]
        for bad in ("2", "one", "-1", b"\xb2", "9" * 5000):  # b"\xb2": latin-1's superscript 2
            response = complete(http, PROMPTS[1], {"X-data-parallel-rank": bad})
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "X-data-parallel-rank"


def test_metrics_report_each_rank_and_the_names_routers_read(dp_server: RemoteServer) -> None:
    text = httpx.get(f"{dp_server.url}/metrics", timeout=30).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        for rank in ("0", "1"):
            assert re.search(rf'^{name}\{{[^}}]*engine="{rank}"[^}}]*\}} ', text, re.M), (name, rank)


def test_a_killed_rank_fails_alone(dp_server: RemoteServer) -> None:
    """Last in the module: it kills rank 1."""
    (pid,) = pids_titled(f"{PROCESS_TITLE}_DP1".encode())
    check_a_killed_rank_is_reported(dp_server, pid)
