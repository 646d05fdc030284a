"""How the front end reaches the engine core. One interface; the transport is the implementation's.

`InprocClient` (here) runs the core in this process; `SyncMPClient` and `AsyncMPClient` (`mp_client.py`)
run it in its own. `front_end.make_client` picks one from the config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from llmserve.config import EngineConfig, ResolvedLimits
from llmserve.contracts import EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class EngineCoreClient(ABC):
    """Contract: `limits` is known once constructed; `get_output()` / `get_output_async()` return the
    next step's outputs (steps whose outputs are empty may be skipped); `shutdown()` releases the core
    and everything it holds. A client is either synchronous (the plain methods) or asyncio (the
    `_async` ones); the other family raises `NotImplementedError`. Once a core in another process has
    died, every call raises `EngineDeadError`, except aborts, which are then no-ops.
    """

    limits: ResolvedLimits

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    def num_engines(self) -> int:
        """Data-parallel ranks behind this client (see dp_client.py)."""
        return 1

    @property
    def dead_ranks(self) -> dict[int, str]:
        """Ranks that died while others serve on (rank: why); a single core's death is `EngineDeadError`."""
        return {}

    def unresponsive_ranks(self, timeout: float) -> dict[int, str]:
        """Live ranks that have sent nothing, not even a heartbeat, for over `timeout` seconds (rank:
        why): stopped or wedged, since a busy core still sends heartbeats. It may yet recover. Only the
        asyncio clients, which read the core's socket all the time, track this; the others report none."""
        return {}

    def check_data_parallel_rank(self, rank: int | None) -> None:
        """A request may pin one of the ranks (`data_parallel_rank`); a single core is rank 0."""
        if rank is not None and not 0 <= rank < self.num_engines:
            raise ValueError(
                f"data_parallel_rank must be between 0 and {self.num_engines - 1} "
                f"(data_parallel_size {self.num_engines}), got {rank}."
            )

    def add_request(self, request: EngineCoreRequest) -> None:
        raise self._unsupported("add_request")

    def abort_requests(self, request_ids: list[str]) -> None:
        """Unknown or finished ids are ignored; the core frees the requests' KV blocks at once."""
        raise self._unsupported("abort_requests")

    def get_output(self) -> EngineCoreOutputs:
        raise self._unsupported("get_output")

    def get_scheduler_stats(self, engine_index: int = 0) -> SchedulerStats:
        raise self._unsupported("get_scheduler_stats")

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise self._unsupported("add_request_async")

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise self._unsupported("abort_requests_async")

    async def get_output_async(self) -> EngineCoreOutputs:
        raise self._unsupported("get_output_async")

    async def get_scheduler_stats_async(self, engine_index: int = 0) -> SchedulerStats:
        raise self._unsupported("get_scheduler_stats_async")

    def _unsupported(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} has no {method}().")


class InprocClient(EngineCoreClient):
    """The core in this process: `get_output()` runs one step. For tests and debugging."""

    def __init__(self, config: EngineConfig) -> None:
        # here, not at the top: a front end whose core runs in another process never loads torch
        from llmserve.engine.core import EngineCore

        self.engine_core = EngineCore(config)
        self.engine_core.warm_up(heap_kept=False)  # this process's heap is its own
        self.limits = self.engine_core.limits

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def get_scheduler_stats(self, engine_index: int = 0) -> SchedulerStats:
        return self.engine_core.scheduler.make_stats()

    def shutdown(self) -> None:
        pass
