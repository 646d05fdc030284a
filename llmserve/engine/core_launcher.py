"""Starting the engine core's process, from the front end's side, and what both sides agree on.

The front end (`mp_client.py`) binds two IPC sockets in a private folder and starts `core_proc.py` as
`python -m llmserve.engine.core_proc` (`start_engine_core`), which connects to them: input (front end
PUSH → core PULL) and output (core PUSH → front end PULL). This module is the front end's half: it
imports nothing of the engine core, so the API server's process loads neither torch nor the kernels.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import site
import subprocess
import sys

import zmq

import llmserve
from llmserve.config import EngineConfig

PROCESS_TITLE = "llmserve::EngineCore"
CORE_MODULE = "llmserve.engine.core_proc"  # run as the core process's `__main__`
LOG_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"  # `llmserve serve`'s, and the core's with it


def make_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], kind: int, address: str, bind: bool
) -> zmq.Socket[bytes]:
    """No high-water mark: a full queue would block (PUSH) or drop messages, and both sides drain theirs."""
    socket = ctx.socket(kind)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return socket


def ipc_addresses(ipc_dir: str) -> tuple[str, str]:
    """The input and the output socket of the core whose front end made `ipc_dir`."""
    return f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output"


def front_end_log_level() -> int | None:
    """The level of llmserve's log lines in this process where logging is configured (the root logger
    has a handler), for the core process to follow; None where it is not."""
    return logging.getLogger("llmserve").getEffectiveLevel() if logging.getLogger().handlers else None


def start_engine_core(
    config: EngineConfig,
    ipc_dir: str,
    rank: int = 0,
    cpus: list[int] | None = None,
    heartbeat: bool = False,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start the core process (data-parallel rank `rank`, on `cpus` where given, sending heartbeats if
    `heartbeat`) for the front end whose sockets are in `ipc_dir`. Returns it and its sentinel, a pipe's
    read end that turns readable (end of file) once the process has exited, as multiprocessing's does;
    the caller closes it. The arguments go over stdin, not argv (where `ps` would show them); the process
    inherits this one's environment (LLMSERVE_CPU_ISA, OMP_NUM_THREADS, ...)."""
    sentinel, exit_fd = os.pipe()  # the core holds the write end until it exits
    args = {
        "ipc_dir": ipc_dir,
        "parent_pid": os.getpid(),
        "log_level": front_end_log_level(),
        "rank": rank,
        "cpus": cpus,
        "heartbeat": heartbeat,
    }
    try:
        payload = pickle.dumps((exit_fd, config, args))
        proc = subprocess.Popen(
            [sys.executable, "-m", CORE_MODULE], stdin=subprocess.PIPE, pass_fds=(exit_fd,), env=_core_env()
        )
    except BaseException:
        os.close(sentinel)
        raise
    finally:
        os.close(exit_fd)
    assert proc.stdin is not None  # stdin=PIPE
    with contextlib.suppress(BrokenPipeError), proc.stdin:  # it died first: the caller reports its exit
        proc.stdin.write(payload)
    return proc, sentinel


def _core_env() -> dict[str, str]:
    """This process's environment, with the folder llmserve was imported from first on PYTHONPATH
    unless it is a site folder (which the core finds anyway): a script that put a checkout on `sys.path`
    itself would otherwise start a core that cannot import llmserve."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(llmserve.__file__)))
    site_folders = [*site.getsitepackages(), site.getusersitepackages()]
    if root not in site_folders and root not in env.get("PYTHONPATH", "").split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env
