"""Engine cores as Ray actors (`--data-parallel-backend ray`): data-parallel ranks on the machines of a
Ray cluster, with the API server where it was started.

For each rank the front end binds its two sockets on TCP (this node's address, ports the OS picks) and
starts an actor that runs `EngineCoreProc` on them: the same messages as a local core's, over the
network. An actor asks Ray for as many CPUs as it computes with (`num_threads`), and Ray places it on a
node that has them. A watcher thread turns the actor's end (a return, a crash, `ray.kill`) into the
sentinel the client waits on, as it waits on a local process's. Actors share the fate of the process
that created them: they end with the front end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any

import setproctitle
import zmq

from llmserve.config import EngineConfig
from llmserve.engine.core_launcher import LOG_FORMAT, PROCESS_TITLE, make_socket
from llmserve.engine.messages import EngineCoreRequestType

SHUTDOWN_TIMEOUT_S = 5.0  # for the actor to finish its step and return, before it is killed
EXIT_GRACE_S = 0.2  # once the actor has ended, how long its result may take to arrive
_connecting = threading.Lock()  # the ranks start from several threads; Ray connects once


def connect_ray() -> Any:
    """The `ray` module, connected: to the cluster that RAY_ADDRESS names or one already running on this
    machine, else a new local one (Ray's own rule)."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("data_parallel_backend='ray' needs Ray: pip install 'llmserve[ray]'.") from e
    with _connecting:
        if not ray.is_initialized():
            # ray.init sets its own SIGTERM handler (sys.exit) where it runs in the main thread: the
            # server's clean shutdown keeps its own
            signals = (signal.SIGINT, signal.SIGTERM)
            handlers = {s: signal.getsignal(s) for s in signals}
            ray.init(log_to_driver=True)
            if threading.current_thread() is threading.main_thread():
                for signum, handler in handlers.items():
                    signal.signal(signum, handler)
    return ray


class EngineCoreActor:
    """Runs in the actor's process: a core, as `core_proc.run_engine_core` runs one in a local process."""

    def run(
        self, config: EngineConfig, input_address: str, output_address: str, rank: int, heartbeat: bool
    ) -> int:
        # here, in the actor's process: the front end that imports this module loads no torch
        from llmserve.engine.core_proc import EngineCoreProc

        setproctitle.setproctitle(f"{PROCESS_TITLE}_DP{rank}")
        logging.basicConfig(level=logging.INFO, format=f"[DP{rank}] {LOG_FORMAT}")
        return EngineCoreProc(config, input_address, output_address, heartbeat).run()


def _bind(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, host: str) -> tuple[zmq.Socket[bytes], str]:
    socket = make_socket(ctx, kind, f"tcp://{host}:*", bind=True)
    return socket, socket.getsockopt_string(zmq.LAST_ENDPOINT)


class RayCore:
    """A client's hold on a core that runs as a Ray actor (`mp_client.CoreHandle`)."""

    def __init__(self, config: EngineConfig, rank: int, heartbeat: bool) -> None:
        self._ray = connect_ray()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        host = self._ray.util.get_node_ip_address()
        try:
            self.input_socket, input_address = _bind(self.ctx, zmq.PUSH, host)
            self.output_socket, output_address = _bind(self.ctx, zmq.PULL, host)
            actor_class = self._ray.remote(num_cpus=config.model_config.num_threads or 1)(EngineCoreActor)
            self.actor = actor_class.remote()
            self.run_ref = self.actor.run.remote(config, input_address, output_address, rank, heartbeat)
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.sentinel, exit_fd = os.pipe()  # the watcher closes the write end when the actor ends
        threading.Thread(target=self._watch, args=(exit_fd,), name=f"ray-rank-{rank}", daemon=True).start()

    def _watch(self, exit_fd: int) -> None:
        with contextlib.suppress(Exception):  # Ray shutting down: the actor is gone too
            self._ray.wait([self.run_ref], timeout=None)
        os.close(exit_fd)

    @property
    def exit_code(self) -> int | None:
        if not self.exited_within(0):
            return None
        try:
            return int(self._ray.get(self.run_ref))
        except Exception:  # the actor died without returning
            return None

    def exited_within(self, timeout: float) -> bool:
        ready, _ = self._ray.wait([self.run_ref], timeout=timeout)
        return bool(ready)

    def exit_reason(self, when: str = "") -> str:
        try:
            detail = f"exit code {int(self._ray.get(self.run_ref, timeout=EXIT_GRACE_S))}"
        except Exception as e:  # RayActorError when it was killed or its node died
            detail = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return f"The engine core actor died{when} ({detail})."

    def release(self) -> None:
        """Ask the actor to stop, then kill it (it keeps its CPUs reserved until it is gone); close the
        sockets. Call once. After Ray itself has shut down (at exit) there is nothing left to end, and a
        Ray call would start a new cluster."""
        if self._ray.is_initialized():
            if not self.exited_within(0):
                with contextlib.suppress(zmq.ZMQError):
                    self.input_socket.send_multipart((EngineCoreRequestType.SHUTDOWN.value, b""), zmq.NOBLOCK)
                self.exited_within(SHUTDOWN_TIMEOUT_S)
            with contextlib.suppress(Exception):
                self._ray.kill(self.actor, no_restart=True)
        os.close(self.sentinel)
        self.ctx.destroy(linger=0)
