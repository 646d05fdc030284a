"""The scheduler's waiting queue, in the order its policy names: arrival (fcfs) or (priority, arrival)."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Collection, Iterator

from llmserve.config import SchedulingPolicy
from llmserve.scheduling.request import Request


class RequestQueue(ABC):
    """New requests are `add`ed; a preempted one is `prepend`ed, so that it is not passed by requests
    that arrived after it. `peek` / `pop` give the next to admit."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def prepend(self, request: Request) -> None: ...

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, requests: Collection[Request]) -> None:
        """Drop these requests (each must be queued), in one pass however many they are."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In no promised order."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, requests: Collection[Request]) -> None:
        if len(requests) == 1:
            self._queue.remove(next(iter(requests)))
        else:
            self._queue = deque(r for r in self._queue if r not in requests)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue(RequestQueue):
    """A heap on (priority, arrival time, insertion count): lower priority values first, then the
    earlier arrival, then the earlier submission. A preempted request keeps its arrival time, so it
    goes back ahead of later arrivals of its priority without a special case."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._count = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._count), request))

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, requests: Collection[Request]) -> None:
        self._heap = [entry for entry in self._heap if entry[3] not in requests]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap)


def make_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
