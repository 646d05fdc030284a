"""Starting the servers the serving benchmark talks to (ours and llama-cpp-python's) as child
processes, and stopping them however the benchmark ends."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llmserve_command(model: str, port: int, dtype: str) -> list[str]:
    return [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", model, "--port", str(port),
            "--dtype", dtype, "--disable-log-stats", "--uvicorn-log-level", "warning"]  # fmt: skip


def llama_cpp_command(python: str, gguf: Path, port: int, context: int, threads: int) -> list[str]:
    """llama-cpp-python's OpenAI server, with the threads our engine uses (its default is half the
    cores). By default it ends the stream in progress when another request arrives: turned off, else
    every concurrent stream but the last would be cut short."""
    return [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(context), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--interrupt_requests", "false"]  # fmt: skip


@contextlib.contextmanager
def running(name: str, command: list[str], port: int) -> Iterator[str]:
    """Start `command`, yield its base URL once /v1/models answers, and stop it on the way out. Its
    output goes to a temporary log, shown only if it fails to start."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{port}/v1"
            if not _answers(base_url, proc):
                log.seek(0)
                tail = log.read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"{name} did not start (exit code {proc.poll()}):\n{tail}")
            yield base_url
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _answers(base_url: str, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/models", timeout=2).status_code == 200:
                return True
        time.sleep(0.5)
    return False
