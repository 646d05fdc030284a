"""The engine core in its own process: `SyncMPClient` (for `LLM`) and `AsyncMPClient` (for `AsyncLLM`).

Both start an `EngineCoreProc` (`python -m llmserve.engine.core_proc`, through `core_launcher.py`), wait
for its READY and watch its process sentinel wherever they wait for its output socket, so a core that dies
wakes every waiter with `EngineDeadError`: never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections import deque
from typing import ClassVar, Protocol, cast

import msgspec
import zmq

from llmserve.config import EngineConfig, ResolvedLimits
from llmserve.contracts import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from llmserve.engine.core_client import EngineCoreClient
from llmserve.engine.core_launcher import ipc_addresses, make_socket, start_engine_core
from llmserve.engine.exceptions import EngineDeadError
from llmserve.engine.messages import (
    EngineCoreEventType,
    EngineCoreFailure,
    EngineCoreRequestType,
    UtilityCall,
    UtilityResult,
)

SHUTDOWN_TIMEOUT_S = 5.0  # for the core to finish its step and exit, before SIGTERM (then SIGKILL)
EXIT_GRACE_MS = 200  # once the core has exited, how long its last message (the error that ended it) may take

_OUTPUTS = EngineCoreEventType.OUTPUTS.value
_UTILITY_RESULT = EngineCoreEventType.UTILITY_RESULT.value
_HEARTBEAT = EngineCoreEventType.HEARTBEAT.value


class CoreHandle(Protocol):
    """What a client holds of its core, wherever it runs: its two sockets, bound here; a sentinel fd that
    turns readable once it has exited; and how it ended. `_CoreProcess` (a local process) and
    `ray_core.RayCore` (a Ray actor) are the two."""

    input_socket: zmq.Socket[bytes]
    output_socket: zmq.Socket[bytes]
    sentinel: int

    @property
    def exit_code(self) -> int | None: ...

    def exited_within(self, timeout: float) -> bool: ...

    def exit_reason(self, when: str = "") -> str: ...

    def release(self) -> None: ...


class _CoreProcess:
    """What a client owns outside Python's heap: the core process and its sentinel, the ZMQ sockets and the
    IPC folder. Kept apart from the client so `weakref.finalize` can release it when the client is dropped
    or the interpreter exits without `shutdown()`."""

    def __init__(self, config: EngineConfig, rank: int, cpus: list[int] | None, heartbeat: bool) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="llmserve-")
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        input_address, output_address = ipc_addresses(self.ipc_dir)
        try:  # binding fails e.g. with a TMPDIR so long that the socket path exceeds the OS limit
            self.input_socket = make_socket(self.ctx, zmq.PUSH, input_address, bind=True)
            self.output_socket = make_socket(self.ctx, zmq.PULL, output_address, bind=True)
            self.proc, self.sentinel = start_engine_core(config, self.ipc_dir, rank, cpus, heartbeat)
        except BaseException:
            self.ctx.destroy(linger=0)
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            raise

    @property
    def exit_code(self) -> int | None:
        return self.proc.returncode

    def exited_within(self, timeout: float) -> bool:
        """Whether the core has exited (and is reaped) within `timeout` seconds."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        return self.proc.returncode is not None

    def exit_reason(self, when: str = "") -> str:
        self.exited_within(EXIT_GRACE_MS / 1000)  # it has exited (its sentinel fired): this reaps it
        code = self.proc.returncode
        detail = (
            f"exit code {code}"
            if code is None or code >= 0
            else f"exit code {code}, {signal.Signals(-code).name}"
        )
        return f"The engine core process died{when} ({detail})."

    def release(self) -> None:
        """Ask the core to stop, then insist; close the sockets; remove the folder. Call once."""
        if self.proc.poll() is None:
            with contextlib.suppress(zmq.ZMQError):  # no peer: it is on its way out
                self.input_socket.send_multipart((EngineCoreRequestType.SHUTDOWN.value, b""), zmq.NOBLOCK)
            if not self.exited_within(SHUTDOWN_TIMEOUT_S):
                self.proc.terminate()
                if not self.exited_within(1.0):
                    self.proc.kill()
                    self.proc.wait()
        os.close(self.sentinel)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class MPClient(EngineCoreClient):
    """Starts the core and owns it. Death is sticky: the first reason found is the one every call reports.
    `rank` and `cpus` place one data-parallel rank (see dp_client.py). The core sends heartbeats to a
    client that reads its socket all the time (`HEARTBEAT`)."""

    HEARTBEAT: ClassVar[bool] = False

    def __init__(self, config: EngineConfig, rank: int = 0, cpus: list[int] | None = None) -> None:
        self._core: CoreHandle
        if config.parallel_config.data_parallel_backend == "ray":
            from llmserve.engine.ray_core import RayCore  # ray is an optional extra

            self._core = RayCore(config, rank, self.HEARTBEAT)
        else:
            self._core = _CoreProcess(config, rank, cpus, self.HEARTBEAT)
        self._finalizer = weakref.finalize(self, self._core.release)
        self._dead_reason: str | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._call_ids = itertools.count()
        try:
            self.limits = self._wait_ready()
        except BaseException:
            self._finalizer()
            raise

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The core's local process (not for a Ray actor)."""
        if not isinstance(self._core, _CoreProcess):
            raise AttributeError("This engine core is a Ray actor, not a local process.")
        return self._core.proc

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    def shutdown(self) -> None:
        """End the core (within a few seconds) and release everything. Safe to call again."""
        self._mark_dead("The engine core was shut down.")
        self._finalizer()

    def _wait_ready(self) -> ResolvedLimits:
        socket, sentinel = self._core.output_socket, self._core.sentinel
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(sentinel, zmq.POLLIN)
        events = dict(poller.poll())
        if socket not in events and not socket.poll(EXIT_GRACE_MS):
            reason = self._core.exit_reason(" while starting")
            if self._core.exit_code == 1:  # an exception before the core could report one
                reason += " See its error above."
            raise EngineDeadError(reason)
        kind, payload = socket.recv_multipart()
        if kind == EngineCoreEventType.READY.value:
            return msgspec.msgpack.decode(payload, type=ResolvedLimits)
        failure = msgspec.msgpack.decode(payload, type=EngineCoreFailure)
        if failure.is_value_error:
            raise ValueError(failure.message)
        raise RuntimeError(f"The engine core failed to start: {failure.error_type}: {failure.message}")

    def _mark_dead(self, reason: str) -> EngineDeadError:
        """Record why the core is gone (the first reason wins) and return the error to raise."""
        if self._dead_reason is None:
            self._dead_reason = reason
        return EngineDeadError(self._dead_reason)

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def _send(self, kind: EngineCoreRequestType, payload: object) -> None:
        """Never blocks while the core lives (no high-water mark); fails once it is gone."""
        self._raise_if_dead()
        frames = (kind.value, self._encoder.encode(payload))
        socket, sentinel = self._core.input_socket, self._core.sentinel
        while True:
            try:
                socket.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:  # no connected peer: the core has died (or is still connecting)
                poller = zmq.Poller()
                poller.register(socket, zmq.POLLOUT)
                poller.register(sentinel, zmq.POLLIN)
                if sentinel in dict(poller.poll()):
                    raise self._mark_dead(self._core.exit_reason()) from None

    def _abort(self, request_ids: list[str]) -> None:
        """A no-op once the core is dead: it holds nothing then, and aborts run in error handlers."""
        if request_ids and not self.is_dead:
            with contextlib.suppress(EngineDeadError):
                self._send(EngineCoreRequestType.ABORT, request_ids)

    def _failure_reason(self, payload: bytes) -> str:
        failure = msgspec.msgpack.decode(payload, type=EngineCoreFailure)
        return f"The engine core failed: {failure.error_type}: {failure.message}"


class SyncMPClient(MPClient):
    """For `LLM`: blocking calls, from one thread at a time."""

    def __init__(self, config: EngineConfig, rank: int = 0, cpus: list[int] | None = None) -> None:
        super().__init__(config, rank, cpus)
        self._outputs: deque[EngineCoreOutputs] = deque()
        self._utility_results: dict[int, msgspec.Raw] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._core.output_socket, zmq.POLLIN)
        self._poller.register(self._core.sentinel, zmq.POLLIN)
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._abort(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        """Block until the core's next outputs, or raise `EngineDeadError` once it is gone."""
        while not self._outputs:
            self.receive()
        return self._outputs.popleft()

    def get_scheduler_stats(self, engine_index: int = 0) -> SchedulerStats:
        call_id = next(self._call_ids)
        self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, "get_scheduler_stats"))
        while call_id not in self._utility_results:
            self.receive()
        return msgspec.msgpack.decode(self._utility_results.pop(call_id), type=SchedulerStats)

    # For a data-parallel client, which waits on several cores with one poller.
    def register(self, poller: zmq.Poller) -> None:
        poller.register(self._core.output_socket, zmq.POLLIN)
        poller.register(self._core.sentinel, zmq.POLLIN)

    def is_ready(self, events: dict[object, int]) -> bool:
        return self._core.output_socket in events or self._core.sentinel in events

    def take_output(self) -> EngineCoreOutputs | None:
        return self._outputs.popleft() if self._outputs else None

    def receive(self) -> None:
        """Wait for one message from the core and file it."""
        self._raise_if_dead()
        socket = self._core.output_socket
        if socket not in dict(self._poller.poll()) and not socket.poll(EXIT_GRACE_MS):
            raise self._mark_dead(self._core.exit_reason())
        kind, payload = socket.recv_multipart()
        if kind == _OUTPUTS:
            self._outputs.append(self._outputs_decoder.decode(payload))
        elif kind == _UTILITY_RESULT:
            result = msgspec.msgpack.decode(payload, type=UtilityResult)
            self._utility_results[result.call_id] = result.result
        else:
            raise self._mark_dead(self._failure_reason(payload))


class AsyncMPClient(MPClient):
    """For `AsyncLLM`: coroutines, all on one event loop. The first call binds that loop and registers
    two readers on it: the output socket (outputs go to a queue, utility results to their futures) and
    the process sentinel (the core's exit). Construction blocks while the core loads. Call `shutdown()`
    from the loop's thread, or once the loop has stopped. Every message, heartbeats included, renews
    the time the core was last heard from (`unresponsive_ranks`).
    """

    HEARTBEAT = True

    def __init__(self, config: EngineConfig, rank: int = 0, cpus: list[int] | None = None) -> None:
        super().__init__(config, rank, cpus)
        self._outputs: asyncio.Queue[EngineCoreOutputs | None] = asyncio.Queue()  # None: the core died
        self._utility_futures: dict[int, asyncio.Future[msgspec.Raw]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_fd: int = self._core.output_socket.FD
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._last_heard = time.monotonic()  # READY has just come

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._start()
        self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._abort(request_ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The core's next outputs; raises `EngineDeadError` once it is gone (outputs it sent before
        dying come first)."""
        self._start()
        outputs = await self._outputs.get()
        if outputs is None:
            self._outputs.put_nowait(None)  # for the next waiter
            raise EngineDeadError(self._dead_reason)
        return outputs

    async def get_scheduler_stats_async(self, engine_index: int = 0) -> SchedulerStats:
        loop = self._start()
        call_id = next(self._call_ids)
        future: asyncio.Future[msgspec.Raw] = loop.create_future()
        self._send(EngineCoreRequestType.UTILITY, UtilityCall(call_id, "get_scheduler_stats"))
        self._utility_futures[call_id] = future
        return msgspec.msgpack.decode(await future, type=SchedulerStats)

    def unresponsive_ranks(self, timeout: float) -> dict[int, str]:
        """Reads what has arrived first, so the answer never waits on the loop's turn to run the reader.
        From the loop's thread."""
        if self.is_dead:
            return {}
        self._read_outputs()
        silent = time.monotonic() - self._last_heard
        if silent <= timeout:
            return {}
        return {
            0: f"The engine core has sent nothing for {silent:.1f} s (engine heartbeat timeout "
            f"{timeout:g} s): it is stopped or hung."
        }

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            if not self.is_dead:
                loop.add_reader(self._output_fd, self._read_outputs)
                loop.add_reader(self._core.sentinel, self._on_core_exit, loop)
                loop.call_soon(self._read_outputs)  # what arrived before the reader was registered
        elif loop is not self._loop:
            # Its outputs would wait forever for a loop that is not running: fail instead.
            raise RuntimeError("AsyncMPClient is bound to the event loop of its first call; this is another.")
        return loop

    def _read_outputs(self) -> None:
        """The socket's FD only says that something changed: read until ZMQ reports nothing left."""
        socket = self._core.output_socket
        try:
            while not self.is_dead and cast(int, socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                kind, payload = socket.recv_multipart(zmq.NOBLOCK)
                self._last_heard = time.monotonic()
                if kind == _OUTPUTS:
                    self._outputs.put_nowait(self._outputs_decoder.decode(payload))
                elif kind == _UTILITY_RESULT:
                    result = msgspec.msgpack.decode(payload, type=UtilityResult)
                    future = self._utility_futures.pop(result.call_id, None)
                    if future is not None and not future.done():
                        future.set_result(result.result)
                elif kind != _HEARTBEAT:
                    self._mark_dead(self._failure_reason(payload))
        except Exception as e:  # a message we cannot read: fail every waiter rather than strand them
            self._mark_dead(f"Reading the engine core's outputs failed: {e!r}")

    def _on_core_exit(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self._core.sentinel)
        # Its last message, the error that ended it, may still be on the way.
        loop.call_later(EXIT_GRACE_MS / 1000, lambda: self._mark_dead(self._core.exit_reason()))

    def _mark_dead(self, reason: str) -> EngineDeadError:
        """Also wakes every waiter (the output queue gets its end marker, utility calls their error)
        and unregisters the readers, before `shutdown()` closes what they watch."""
        if self._dead_reason is None:
            self._outputs.put_nowait(None)
            for future in self._utility_futures.values():
                if not future.done():
                    future.set_exception(EngineDeadError(reason))
            self._utility_futures.clear()
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._output_fd)
                self._loop.remove_reader(self._core.sentinel)
        return super()._mark_dead(reason)
