"""`llmserve chat` and `llmserve complete` against a real server: answers stream to stdout piece by
piece, equal the server's own greedy answers, and `chat` sends its history. The server here runs with
`--disable-playground` and `--api-key`, so this module also checks that `/` is then a 404."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.entrypoints.conftest import SERVER_ARGS
from tests.entrypoints.remote_server import RemoteServer

API_KEY = "cli-test-key"
SAMPLING = ["--temperature", "0", "--max-tokens", "24"]


@pytest.fixture(scope="module")
def server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer([*SERVER_ARGS, "--api-key", API_KEY, "--disable-playground"])
    yield remote
    remote.stop()


@dataclass
class Run:
    reads: list[bytes]  # stdout, as the reads that received it
    stderr: str
    code: int

    @property
    def stdout(self) -> str:
        return b"".join(self.reads).decode()


def run_cli(server: RemoteServer, *args: str, stdin: str = "", key_in_env: bool = True) -> Run:
    # Without PYTHONUNBUFFERED, which would hide a missing flush: pipes are block-buffered.
    env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "PYTHONUNBUFFERED")}
    if key_in_env:
        env["OPENAI_API_KEY"] = API_KEY
    command = [sys.executable, "-m", "llmserve.entrypoints.cli", *args, "--url", f"{server.url}/v1"]
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
        reads = []
        while piece := os.read(proc.stdout.fileno(), 65536):
            reads.append(piece)
        proc.stdout.close()
        code = proc.wait(60)
        stderr.seek(0)
        return Run(reads, stderr.read().decode(), code)


def greedy(server: RemoteServer, path: str, body: dict[str, Any]) -> str:
    """The server's non-streamed answer at temperature 0."""
    response = httpx.post(
        f"{server.url}/v1/{path}",
        json={**body, "temperature": 0, "max_tokens": 24},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    choice = response.json()["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def test_chat_quick_streams_the_greedy_answer(server: RemoteServer) -> None:
    question = "What is the capital of France?"
    run = run_cli(server, "chat", "-q", question, *SAMPLING)
    assert run.code == 0, run.stderr
    expected = greedy(server, "chat/completions", {"messages": [{"role": "user", "content": question}]})
    assert run.stdout == expected + "\n"
    assert len(run.reads) > 1, "the answer arrived in one piece: not streamed"


def test_complete_quick_streams_the_greedy_answer(server: RemoteServer) -> None:
    prompt = "The capital of France is"
    run = run_cli(server, "complete", "-q", prompt, "--api-key", API_KEY, *SAMPLING, key_in_env=False)
    assert run.code == 0, run.stderr
    assert run.stdout == greedy(server, "completions", {"prompt": prompt}) + "\n"
    assert len(run.reads) > 1, "the answer arrived in one piece: not streamed"


def test_chat_sends_its_history(server: RemoteServer) -> None:
    system, first, second = "You are a pirate.", "My name is Ada.", "What is my name?"
    # An empty line is skipped: it costs one more prompt, no request.
    run = run_cli(server, "chat", "--system-prompt", system, *SAMPLING, stdin=f"{first}\n\n{second}\n")
    assert run.code == 0, run.stderr
    history = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    answer = greedy(server, "chat/completions", {"messages": history})
    history += [{"role": "assistant", "content": answer}, {"role": "user", "content": second}]
    assert run.stdout == f"> {answer}\n> > {greedy(server, 'chat/completions', {'messages': history})}\n> \n"


def test_no_key_no_page(server: RemoteServer) -> None:
    assert httpx.get(f"{server.url}/", timeout=10).status_code == 404  # --disable-playground
    run = run_cli(server, "chat", "-q", "Hi", key_in_env=False)
    assert (run.code, run.stdout) == (1, "")
    assert "error: Incorrect or missing API key" in run.stderr
