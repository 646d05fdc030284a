"""`EngineCoreProc`: the engine core in its own process, fed and drained over ZMQ.

The front end starts this module as `python -m llmserve.engine.core_proc` (`core_launcher.py`), and it
connects to the front end's two sockets. Every message is a type frame and a msgpack frame (see
`messages.py`); only the start-up arguments, written once to the process's stdin, are pickled. A fresh
interpreter running this module, unlike multiprocessing's spawn, never imports the caller's `__main__`,
so scripts need no `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import setproctitle
import zmq

from llmserve.config import EngineConfig
from llmserve.contracts import EngineCoreRequest
from llmserve.engine.core import EngineCore
from llmserve.engine.core_launcher import LOG_FORMAT, PROCESS_TITLE, ipc_addresses, make_socket
from llmserve.engine.heap_reuse import keep_freed_heap
from llmserve.engine.messages import (
    HEARTBEAT_INTERVAL_S,
    EngineCoreEventType,
    EngineCoreFailure,
    EngineCoreRequestType,
    UtilityCall,
    UtilityResult,
)

PARENT_POLL_S = 0.5  # how often the core checks that the process that started it is still there
LINGER_MS = 1000  # how long closing waits for unsent outputs, so the last error reaches the front end

# A decoded message, or the exception that stopped the input thread (the busy loop re-raises it).
InputItem = tuple[EngineCoreRequestType, Any] | BaseException
OutputItem = tuple[EngineCoreEventType, Any]


def main() -> None:
    """`python -m llmserve.engine.core_proc`: reads what `start_engine_core` wrote to stdin and runs."""
    exit_fd, config, args = pickle.load(sys.stdin.buffer)
    os.set_inheritable(exit_fd, False)  # a process this one starts must not hold the sentinel open
    run_engine_core(config, **args)


def run_engine_core(
    config: EngineConfig,
    ipc_dir: str,
    parent_pid: int,
    log_level: int | None = None,
    rank: int = 0,
    cpus: list[int] | None = None,
    heartbeat: bool = False,
) -> None:
    """Runs the core: exits 0 after a shutdown request, 1 after a failure. A new process starts with
    logging unconfigured, which would drop the start-up lines (memory, kernels), so it logs at the front
    end's `log_level` where that has one. A data-parallel rank names itself in its title and log lines,
    and keeps to its `cpus` (set before its compute threads start, which inherit them)."""
    data_parallel = config.parallel_config.data_parallel_size > 1
    setproctitle.setproctitle(f"{PROCESS_TITLE}_DP{rank}" if data_parallel else PROCESS_TITLE)
    if cpus:
        os.sched_setaffinity(0, cpus)
    if log_level is not None:
        logging.basicConfig(
            level=log_level, format=f"[DP{rank}] {LOG_FORMAT}" if data_parallel else LOG_FORMAT
        )
    # Ctrl-C reaches the whole process group; the front end owns it and shuts this process down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid, ipc_dir), daemon=True).start()
    exit_code = EngineCoreProc(config, *ipc_addresses(ipc_dir), heartbeat).run()
    # Skip the interpreter's teardown (over a second with torch loaded): nothing is left to clean up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _exit_with_parent(parent_pid: int, ipc_dir: str) -> None:
    """Polls rather than using PR_SET_PDEATHSIG, which fires when the parent *thread* that started this
    process ends (say, an executor thread), not when the parent process does. A parent that died
    cannot remove its IPC folder, so this process does."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    shutil.rmtree(ipc_dir, ignore_errors=True)
    os._exit(1)


class EngineCoreProc:
    """Runs an `EngineCore` between two queues. The input thread decodes messages into one, the output
    thread encodes outputs from the other, so the busy loop (the main thread) spends its time in
    `step()` and never waits on a socket. With `heartbeat`, for a front end that reads all the time (an
    idle one that does not would only pile them up), the output thread also sends HEARTBEATs.
    """

    def __init__(
        self, config: EngineConfig, input_address: str, output_address: str, heartbeat: bool = False
    ) -> None:
        self.config = config
        self.heartbeat_interval = HEARTBEAT_INTERVAL_S if heartbeat else None
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # Both connected before the model loads, so the front end can send as soon as it sees READY.
        self.input_socket = make_socket(self.ctx, zmq.PULL, input_address, bind=False)
        self.output_socket = make_socket(self.ctx, zmq.PUSH, output_address, bind=False)
        self.input_queue: queue.Queue[InputItem] = queue.Queue()
        self.output_queue: queue.Queue[OutputItem | None] = queue.Queue()
        self.input_thread = threading.Thread(target=self._receive_inputs, name="CoreInput", daemon=True)
        self.output_thread = threading.Thread(target=self._send_outputs, name="CoreOutput", daemon=True)

    def run(self) -> int:
        """Start the core, report READY (or why not), serve until told to stop; returns the exit code."""
        self.output_thread.start()
        try:
            engine_core = EngineCore(self.config)
            # What start-up made (the model, the tokenizer's tables) lives as long as this process:
            # frozen, the cyclic collector's passes while serving no longer walk it (1.6% of a Gemma 3
            # run's CPU). Then the heap keeps what steps free for the next ones (heap_reuse.py), the
            # warm-up's first.
            gc.collect()
            gc.freeze()
            engine_core.warm_up(heap_kept=keep_freed_heap())
        except Exception as e:
            self._report(EngineCoreEventType.STARTUP_FAILED, e)
            self.input_socket.close()  # its thread never started
            return self._close(1)
        self.output_queue.put((EngineCoreEventType.READY, engine_core.limits))
        self.input_thread.start()
        try:
            self._busy_loop(engine_core)
        except Exception as e:
            self._report(EngineCoreEventType.ERROR, e)
            return self._close(1)
        return self._close(0)

    def _busy_loop(self, core: EngineCore) -> None:
        """Block on the input queue only when idle; otherwise take what arrived, then run one step."""
        while True:
            if not core.has_unfinished_requests() and not self._handle(core, self.input_queue.get()):
                return
            while not self.input_queue.empty():
                if not self._handle(core, self.input_queue.get_nowait()):
                    return
            if core.has_unfinished_requests():
                outputs = core.step()
                if outputs.outputs:
                    self.output_queue.put((EngineCoreEventType.OUTPUTS, outputs))

    def _handle(self, core: EngineCore, item: InputItem) -> bool:
        """Apply one message; False means shut down."""
        if isinstance(item, BaseException):
            raise item
        kind, payload = item
        if kind is EngineCoreRequestType.ADD:
            core.add_request(payload)
        elif kind is EngineCoreRequestType.ABORT:
            core.abort_requests(payload)  # frees their KV blocks now
        elif kind is EngineCoreRequestType.UTILITY:
            self._call_utility(core, payload)
        else:
            return False
        return True

    def _call_utility(self, core: EngineCore, call: UtilityCall) -> None:
        if call.method != "get_scheduler_stats":
            raise ValueError(f"Unknown utility method {call.method!r}.")
        result = msgspec.Raw(msgspec.msgpack.encode(core.scheduler.make_stats()))
        self.output_queue.put((EngineCoreEventType.UTILITY_RESULT, UtilityResult(call.call_id, result)))

    def _report(self, event: EngineCoreEventType, error: Exception) -> None:
        if event is EngineCoreEventType.ERROR or not isinstance(error, ValueError):
            traceback.print_exc()  # a bad config needs only its message; anything else, the whole story
        failure = EngineCoreFailure(type(error).__name__, str(error), isinstance(error, ValueError))
        self.output_queue.put((event, failure))

    def _receive_inputs(self) -> None:
        decoders: dict[EngineCoreRequestType, msgspec.msgpack.Decoder[Any]] = {
            EngineCoreRequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
            EngineCoreRequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
            EngineCoreRequestType.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
        }
        try:
            while True:
                kind_frame, payload = self.input_socket.recv_multipart()
                kind = EngineCoreRequestType(kind_frame)
                if kind is EngineCoreRequestType.SHUTDOWN:
                    self.input_queue.put((kind, None))
                    return
                self.input_queue.put((kind, decoders[kind].decode(payload)))
        except zmq.ContextTerminated:
            pass  # the busy loop failed and `_close` is ending the process
        except Exception as e:
            self.input_queue.put(e)
        finally:
            self.input_socket.close()

    def _send_outputs(self) -> None:
        """Also the heartbeat: this thread waits on a queue, never on a step (which releases the GIL in
        its kernels), so it keeps sending while the busy loop computes; READY must come first, so the
        heartbeat starts with it."""
        encoder = msgspec.msgpack.Encoder()
        heartbeat = (EngineCoreEventType.HEARTBEAT.value, encoder.encode(None))
        interval: float | None = None  # no heartbeat before READY
        while True:
            try:
                item = self.output_queue.get(timeout=interval)
            except queue.Empty:
                self.output_socket.send_multipart(heartbeat)
                continue
            if item is None:
                break
            event, payload = item
            self.output_socket.send_multipart((event.value, encoder.encode(payload)))
            if event is EngineCoreEventType.READY:
                interval = self.heartbeat_interval
        self.output_socket.close(linger=LINGER_MS)

    def _close(self, exit_code: int) -> int:
        """Flush the outputs (the last may be the error the front end waits for), then end the threads."""
        self.output_queue.put(None)
        self.output_thread.join()
        self.ctx.term()  # a blocked receive in the input thread fails with ETERM; it closes its socket
        return exit_code


if __name__ == "__main__":
    main()
