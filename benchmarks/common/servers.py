"""Starting the servers the serving benchmark talks to (ours, llama-cpp-python's and llama.cpp's own
`llama-server`) as child processes, and stopping them however the benchmark ends."""

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


def llmserve_command(
    model: str, port: int, dtype: str, quantization: str = "none", kv_cache_dtype: str = "auto"
) -> list[str]:
    return [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", model, "--port", str(port),
            "--dtype", dtype, "--quantization", quantization, "--kv-cache-dtype", kv_cache_dtype,
            "--disable-log-stats", "--uvicorn-log-level", "warning"]  # fmt: skip


def llama_cpp_command(python: str, gguf: Path, port: int, context: int, threads: int) -> list[str]:
    """llama-cpp-python's OpenAI server, with the threads our engine uses (its default is half the
    cores). By default it ends the stream in progress when another request arrives: turned off, else
    every concurrent stream but the last would be cut short."""
    return [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(context), "--n_threads", str(threads),
            "--n_threads_batch", str(threads), "--interrupt_requests", "false"]  # fmt: skip


def llama_server_command(
    binary: str, gguf: Path, port: int, slots: int, context: int, threads: int
) -> list[str]:
    """llama.cpp's own server, batching continuously across `slots` requests at once. It splits `-c`
    evenly among its slots, so each request gets `context` tokens."""
    return [binary, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "--cont-batching", "--ctx-size", str(slots * context),
            "--threads", str(threads)]  # fmt: skip


@contextlib.contextmanager
def running(name: str, command: list[str], port: int, ready: str = "/v1/models") -> Iterator[str]:
    """Start `command`, yield its base URL once the path `ready` answers 200 (llama-server answers 503
    on every path while it loads, then 200 on /health), and stop it on the way out. Its output goes to a
    temporary log, shown only if it fails to start."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            if not _answers(f"http://127.0.0.1:{port}{ready}", proc):
                log.seek(0)
                tail = log.read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"{name} did not start (exit code {proc.poll()}):\n{tail}")
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _answers(url: str, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2).status_code == 200:
                return True
        time.sleep(0.5)
    return False
