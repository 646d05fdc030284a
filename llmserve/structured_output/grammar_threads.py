"""Threads with a large stack for grammar work.

llguidance validates and compiles grammars recursively in native code. The limits (limits.py) keep
every accepted grammar far from the depth that overflows a default thread stack; running the native
work on threads whose stack is much larger keeps a margin for what the limits do not model, and keeps
it off the threads that prepare other requests.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

# Address space only: a thread's stack is touched (made resident) as deep as it is used.
STACK_BYTES = 256 << 20
# threading.stack_size is process-wide: held while the pool's threads start.
_STACK_SIZE_LOCK = threading.Lock()


class LargeStackExecutor(Executor):
    """`workers` daemon threads of `STACK_BYTES` stack each, started at once, taking work in order. A
    task still running when its caller gave up on it runs to its end (native code cannot be
    interrupted), holding one worker; the grammar limits bound how long that is."""

    def __init__(self, workers: int, name: str) -> None:
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(STACK_BYTES)
            try:
                for thread in self._threads:
                    thread.start()
            finally:
                threading.stack_size(previous)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if self._stopped:
            raise RuntimeError("cannot submit work after shutdown")
        future: Future[T] = Future()
        self._work.put((future, lambda: fn(*args, **kwargs)))
        return future

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            future, work = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as e:  # noqa: BLE001 (handed to the caller through the future)
                future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._stopped = True
        if cancel_futures:
            while not self._work.empty():
                item = self._work.get_nowait()
                if item is not None:
                    item[0].cancel()
        for _ in self._threads:
            self._work.put(None)
        if wait:
            for thread in self._threads:
                thread.join()
