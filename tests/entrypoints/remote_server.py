"""A real `llmserve serve` process on a free local port, for tests that talk HTTP to it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 180.0
# One math thread: the suite shares few cores, and OpenMP threads that wait on a descheduled peer
# make each matmul many times slower than one thread alone.
THREAD_ENV = {"OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    """Direct child processes (Linux /proc; empty elsewhere)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class RemoteServer:
    """Starts the server with `args` and waits for /health; `stop()` sends SIGTERM and waits."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llmserve-", suffix=".log", delete=False)  # noqa: SIM115 (closed in stop)
        command = [sys.executable, "-m", "llmserve.entrypoints.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **THREAD_ENV, **(env or {})},
        )
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"The server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        output = self.output()
        self.stop()
        raise TimeoutError(f"The server did not become healthy:\n{output}")

    def output(self) -> str:
        return Path(self.log.name).read_text()[-5000:]

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code (SIGKILL, and an error, if it does not exit in time). Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)
        return self.proc.returncode
