"""Data parallelism: N engine cores behind one front end, as vLLM's `DPLBAsyncMPClient`.

Each rank is a whole `EngineCoreProc` with its own KV pool and compute threads, started and watched
exactly as a single core is (`mp_client.py`). The front end sends each new request to the rank with the
fewest unfinished requests (the ones it sent there and has not seen finish: the rank's waiting + running,
including those still on the wire), then the lowest KV cache usage the rank last reported; a request may
pin its rank (`data_parallel_rank`, the server's `X-data-parallel-rank` header). Aborts go to the rank
that owns the request. In `AsyncLLM` a rank that dies fails only its own requests (`RANK_DIED`) and
leaves the service to the others; the engine is dead once every rank is.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import zmq

from llmserve.config import EngineConfig
from llmserve.contracts import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from llmserve.engine.core_client import EngineCoreClient
from llmserve.engine.exceptions import EngineDeadError
from llmserve.engine.mp_client import AsyncMPClient, MPClient, SyncMPClient
from llmserve.model_executor.cpu_threads import rank_placement

Rank = TypeVar("Rank", bound=MPClient)


def rank_configs(config: EngineConfig) -> list[tuple[EngineConfig, list[int] | None]]:
    """Each rank's config and CPUs. Unset, a rank's threads are this process's cores divided among the
    ranks (its default KV pool, a share of the host's, each rank sizes itself: `kv_cache_budget`)."""
    size = config.parallel_config.data_parallel_size
    threads, cpus = rank_placement(size, config.model_config.num_threads)
    model = dataclasses.replace(config.model_config, num_threads=threads)
    rank_config = dataclasses.replace(config, model_config=model)
    return [(rank_config, cpus[rank] if cpus else None) for rank in range(size)]


def start_ranks(
    config: EngineConfig, client: Callable[[EngineConfig, int, list[int] | None], Rank]
) -> list[Rank]:
    """Every rank's core, loading at the same time; if one fails to start, the others are shut down."""
    if config.parallel_config.data_parallel_backend == "ray":
        from llmserve.engine.ray_core import connect_ray

        connect_ray()  # from this thread: Ray sets its signal handlers only in the main thread
    placed = rank_configs(config)
    with ThreadPoolExecutor(len(placed), thread_name_prefix="start-rank") as pool:
        starting = [
            pool.submit(client, rank_config, rank, cpus) for rank, (rank_config, cpus) in enumerate(placed)
        ]
        started, error = [], None
        for future in starting:
            try:
                started.append(future.result())
            except Exception as e:  # re-raised below, once every rank is accounted for
                error = error or e
    if error is not None:
        for rank in started:
            rank.shutdown()
        raise error
    return started


class LoadBalancer:
    """Which rank serves a new request, and which rank owns each unfinished one."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.owner: dict[str, int] = {}
        self.unfinished = [0] * size
        self.kv_cache_usage = [0.0] * size
        self.dead: dict[int, str] = {}  # rank: why it died

    def assign(self, request: EngineCoreRequest) -> int:
        rank = request.data_parallel_rank
        if rank is None:
            live = [r for r in range(self.size) if r not in self.dead]
            rank = min(live, key=lambda r: (self.unfinished[r], self.kv_cache_usage[r], r))
        elif rank in self.dead:
            raise EngineDeadError(f"Data-parallel rank {rank} is dead: {self.dead[rank]}")
        self.owner[request.request_id] = rank
        self.unfinished[rank] += 1
        return rank

    def release(self, request_id: str) -> None:
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            self.unfinished[rank] -= 1

    def observe(self, rank: int, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.kv_cache_usage[rank] = outputs.scheduler_stats.kv_cache_usage
        for output in outputs.outputs:
            # an id aborted on one rank and reused on another: the first rank's last output is not its end
            if output.finished and self.owner.get(output.request_id) == rank:
                self.release(output.request_id)

    def by_rank(self, request_ids: Sequence[str]) -> dict[int, list[str]]:
        """The requests' owners (unknown or finished ids are left out), releasing the requests."""
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.owner.get(request_id)
            if rank is not None:
                groups.setdefault(rank, []).append(request_id)
                self.release(request_id)
        return groups

    def fail_rank(self, rank: int, reason: str) -> list[str]:
        """Mark `rank` dead; returns the requests it held, now released."""
        self.dead[rank] = reason
        lost = [request_id for request_id, owner in self.owner.items() if owner == rank]
        for request_id in lost:
            self.release(request_id)
        return lost

    @property
    def all_dead(self) -> bool:
        return len(self.dead) == self.size


class DPLBAsyncMPClient(EngineCoreClient):
    """For `AsyncLLM` with `data_parallel_size` > 1: one `AsyncMPClient` per rank, one merged output
    stream (a task per rank moves its outputs into it, tagged with the rank)."""

    def __init__(self, config: EngineConfig) -> None:
        self.ranks = start_ranks(config, AsyncMPClient)
        self.limits = self.ranks[0].limits
        self.balancer = LoadBalancer(len(self.ranks))
        self._outputs: asyncio.Queue[EngineCoreOutputs | None] = asyncio.Queue()  # None: every rank died
        self._readers: list[asyncio.Task[None]] = []

    @property
    def num_engines(self) -> int:
        return len(self.ranks)

    @property
    def dead_ranks(self) -> dict[int, str]:
        return dict(self.balancer.dead)

    def unresponsive_ranks(self, timeout: float) -> dict[int, str]:
        return {
            rank: f"Data-parallel rank {rank}: {why}"
            for rank, client in enumerate(self.ranks)
            if rank not in self.balancer.dead
            for why in client.unresponsive_ranks(timeout).values()
        }

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """A rank found dead on sending (before its reader has reported it) takes no more requests; an
        unpinned request then goes to another."""
        self._start()
        while True:
            if self.balancer.all_dead:
                raise EngineDeadError(self._death())
            rank = self.balancer.assign(request)
            try:
                await self.ranks[rank].add_request_async(request)
                return
            except EngineDeadError as e:
                self.balancer.release(request.request_id)
                self.balancer.dead.setdefault(rank, f"Data-parallel rank {rank} died: {e}")
                if request.data_parallel_rank is not None:
                    raise
            except BaseException:
                self.balancer.release(request.request_id)
                raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for rank, ids in self.balancer.by_rank(request_ids).items():
            await self.ranks[rank].abort_requests_async(ids)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._start()
        outputs = await self._outputs.get()
        if outputs is None:
            self._outputs.put_nowait(None)  # for the next waiter
            raise EngineDeadError(self._death())
        return outputs

    async def get_scheduler_stats_async(self, engine_index: int = 0) -> SchedulerStats:
        return await self.ranks[engine_index].get_scheduler_stats_async()

    def shutdown(self) -> None:
        """From the loop's thread, as `AsyncMPClient.shutdown`; waiters then get `EngineDeadError`."""
        for reader in self._readers:
            reader.cancel()
        for rank in self.ranks:
            rank.shutdown()
        for index in range(len(self.ranks)):
            self.balancer.dead.setdefault(index, "The engine core was shut down.")
        self._outputs.put_nowait(None)

    def _start(self) -> None:
        if not self._readers:
            self._readers = [asyncio.create_task(self._read(rank)) for rank in range(len(self.ranks))]

    async def _read(self, rank: int) -> None:
        try:
            while True:
                outputs = await self.ranks[rank].get_output_async()
                outputs.engine_index = rank
                self.balancer.observe(rank, outputs)
                self._outputs.put_nowait(outputs)
        except EngineDeadError as e:
            reason = f"Data-parallel rank {rank} died: {e}"
            lost = self.balancer.fail_rank(rank, reason)
            failed = [EngineCoreOutput(r, [], FinishReason.RANK_DIED, error=reason) for r in lost]
            # zeros for its gauges: a dead rank holds nothing, and a router must not see its last load
            self._outputs.put_nowait(EngineCoreOutputs(failed, SchedulerStats(), engine_index=rank))
            if self.balancer.all_dead:
                self._outputs.put_nowait(None)

    def _death(self) -> str:
        return "Every data-parallel rank died. " + " ".join(self.balancer.dead.values())


class DPSyncMPClient(EngineCoreClient):
    """For `LLM` with `data_parallel_size` > 1: one `SyncMPClient` per rank, read together. Offline, a
    rank that dies ends the engine (`EngineDeadError`), as a single core's death does."""

    def __init__(self, config: EngineConfig) -> None:
        self.ranks = start_ranks(config, SyncMPClient)
        self.limits = self.ranks[0].limits
        self.balancer = LoadBalancer(len(self.ranks))
        self._poller = zmq.Poller()
        for rank in self.ranks:
            rank.register(self._poller)

    @property
    def num_engines(self) -> int:
        return len(self.ranks)

    def add_request(self, request: EngineCoreRequest) -> None:
        rank = self.balancer.assign(request)
        self.ranks[rank].add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rank, ids in self.balancer.by_rank(request_ids).items():
            self.ranks[rank].abort_requests(ids)

    def get_output(self) -> EngineCoreOutputs:
        """The next outputs of any rank, waiting on all of them at once."""
        while True:
            for index, rank in enumerate(self.ranks):
                outputs = rank.take_output()
                if outputs is not None:
                    outputs.engine_index = index
                    self.balancer.observe(index, outputs)
                    return outputs
            ready = dict(self._poller.poll())
            for rank in self.ranks:
                if rank.is_ready(ready):
                    rank.receive()  # raises EngineDeadError once that rank is gone

    def get_scheduler_stats(self, engine_index: int = 0) -> SchedulerStats:
        return self.ranks[engine_index].get_scheduler_stats()

    def shutdown(self) -> None:
        with ThreadPoolExecutor(len(self.ranks)) as pool:
            list(pool.map(lambda rank: rank.shutdown(), self.ranks))
