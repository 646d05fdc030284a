"""`AsyncLLM`: the streaming API. Requests go to the engine core process; one background task turns its
outputs into `RequestOutput`s and hands each to its request's `RequestOutputCollector`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncGenerator, Iterable
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from llmserve.config import DEFAULT_MODEL, EngineArgs, EngineConfig
from llmserve.contracts import EngineCoreOutput, FinishReason, SchedulerStats
from llmserve.engine.exceptions import EngineDeadError
from llmserve.engine.front_end import FrontEnd
from llmserve.engine.input_processor import PromptType
from llmserve.engine.output_collector import RequestOutputCollector
from llmserve.engine.parallel_sampling import fan_out
from llmserve.engine.queue_limits import QueueLimits, QueueTimeoutError
from llmserve.metrics.loggers import LoggingStatLogger
from llmserve.metrics.stats import IterationStats
from llmserve.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from llmserve.pooling_params import PoolingParams
from llmserve.sampling_params import RequestOutputKind, SamplingParams
from llmserve.structured_output.grammars import StructuredOutputError

logger = logging.getLogger("llmserve")

# Outputs are processed in chunks of this many, yielding to the event loop in between, so that one
# big step does not stall the streams that are being written.
OUTPUT_CHUNK_SIZE = 256


class StatLogger(Protocol):
    def record(
        self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats, engine_index: int = 0
    ) -> None: ...

    def maybe_log(self) -> None: ...


class AsyncLLM:
    """Constructed like `LLM`: `AsyncLLM()` loads the default model; keyword arguments are `EngineArgs`
    fields. With `start_engine_loop` the output handler starts as soon as an event loop runs (at
    construction inside one, else with the first request); without, only with the first request.
    `max_num_queued_requests` / `max_num_queued_tokens` bound the requests without a first output
    yet (see `QueueLimits`): past them, `add_request` raises `QueueFullError`.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        log_requests: bool = False,
        log_stats: bool = True,
        start_engine_loop: bool = True,
        stat_loggers: Iterable[StatLogger] = (),
        max_num_queued_requests: int | None = None,
        max_num_queued_tokens: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        config = EngineArgs.from_kwargs(model=model, **engine_kwargs).create_engine_config()
        self.queue = QueueLimits(max_num_queued_requests, max_num_queued_tokens)
        self._init(config, log_requests, log_stats, list(stat_loggers))
        if start_engine_loop:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return
            self._start_output_handler()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **options: Any) -> AsyncLLM:
        return cls(**dataclasses.asdict(engine_args), **options)

    def _init(
        self, config: EngineConfig, log_requests: bool, log_stats: bool, stat_loggers: list[StatLogger]
    ) -> None:
        self.config = config
        self.log_requests = log_requests
        front = FrontEnd.start(config, asyncio_mode=True)
        self.tokenizer = front.tokenizer
        self.engine_core = front.engine_core
        self.limits = front.limits
        self.input_processor = front.input_processor
        self.output_processor = front.output_processor
        self.stat_loggers: list[StatLogger] = ([LoggingStatLogger()] if log_stats else []) + stat_loggers
        for stat_logger in stat_loggers:
            engines = getattr(stat_logger, "num_engines", None)
            if engines is not None and engines != self.engine_core.num_engines:
                self.engine_core.shutdown()
                raise ValueError(
                    f"A stat logger for {engines} engine(s) was given to an engine of "
                    f"{self.engine_core.num_engines} data-parallel ranks."
                )
        self._output_handler: asyncio.Task[None] | None = None
        self._dead_error: BaseException | None = None

    @property
    def errored(self) -> bool:
        return self._dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._output_handler is not None and not self._output_handler.done()

    async def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tokenizer

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
    ) -> RequestOutputCollector:
        """Validate (raising `ValueError` before anything reaches the core), admit (raising
        `QueueFullError` when the queue is full) and submit; to `data_parallel_rank` where given.
        `PoolingParams` make a pooling request (see `encode`)."""
        if self._dead_error is not None:
            raise EngineDeadError(f"The engine is dead: {self._dead_error}")
        self.config.scheduler_config.check_priority(priority)
        self.engine_core.check_data_parallel_rank(data_parallel_rank)
        if isinstance(params, PoolingParams):
            processor, text, parent = self.input_processor, None, None
            requests = [processor.process_pooling_inputs(request_id, prompt, params, arrival_time, priority)]
        else:
            text, parent, requests = fan_out(
                self.input_processor, request_id, prompt, params, arrival_time, priority
            )
        for request in requests:
            request.data_parallel_rank = data_parallel_rank
        if request_id in self.output_processor.request_states or request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        self.queue.admit(requests)
        self._start_output_handler()
        kind = params.output_kind if isinstance(params, SamplingParams) else RequestOutputKind.FINAL_ONLY
        collector = RequestOutputCollector(kind)
        try:
            for index, request in enumerate(requests):
                self.output_processor.add_request(request, text, parent, index, collector)
            for request in requests:
                await self.engine_core.add_request_async(request)
        except BaseException:  # no child may outlive a failed submission (n > 1: those already sent)
            self.queue.release(r.request_id for r in requests)
            await asyncio.shield(self.abort(request_id))
            raise
        if self.log_requests:
            logger.info("Added request %s.", request_id)
        return collector

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        arrival_time: float | None = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream this request's outputs. Closing or cancelling the stream aborts the request. A
        request that waited in the core past `max_queue_time` raises `QueueTimeoutError`; one whose
        grammar failed in the core, `StructuredOutputError`; one whose data-parallel rank died,
        `EngineDeadError`."""
        collector: RequestOutputCollector | None = None
        try:
            collector = await self.add_request(
                request_id, prompt, sampling_params, arrival_time, priority, data_parallel_rank
            )
            finished = False
            while not finished:
                output = collector.get_nowait() or await collector.get()
                assert isinstance(output, RequestOutput)
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if collector is not None:
                await asyncio.shield(self.abort(request_id))
            raise

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncGenerator[PoolingRequestOutput[PoolingOutput], None]:
        """vLLM's: the prompt's pooled vector, in one (finished) output, from an engine of the pooling
        runner. Closing or cancelling the stream aborts the request."""
        collector: RequestOutputCollector | None = None
        try:
            collector = await self.add_request(request_id, prompt, pooling_params, priority=priority)
            output = collector.get_nowait() or await collector.get()
            assert isinstance(output, PoolingRequestOutput)
            yield output
        except (asyncio.CancelledError, GeneratorExit):
            if collector is not None:
                await asyncio.shield(self.abort(request_id))
            raise

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (parents abort every child); unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        core_ids = self.output_processor.abort_requests(ids)
        self.queue.release(core_ids)
        if self._dead_error is None and core_ids:
            with contextlib.suppress(EngineDeadError):  # the output handler reports the death
                await self.engine_core.abort_requests_async(core_ids)
        if self.log_requests:
            logger.info("Aborted request(s) %s.", ", ".join(ids))

    def _start_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                items = outputs.outputs
                if self.queue:  # any output, the last one too, ends a request's wait
                    self.queue.release(o.request_id for o in items)
                for start in range(0, max(len(items), 1), OUTPUT_CHUNK_SIZE):
                    chunk = items[start : start + OUTPUT_CHUNK_SIZE]
                    await self._fail_requests(chunk)
                    processed = self.output_processor.process_outputs(chunk)
                    if processed.reqs_to_abort:
                        await self.engine_core.abort_requests_async(processed.reqs_to_abort)
                    self._record_stats(outputs.scheduler_stats, processed.stats, outputs.engine_index)
                    if self.log_requests:
                        for finished in processed.stats.finished_requests:
                            logger.info("Finished a request (%s).", finished.finish_reason)
                    if start + OUTPUT_CHUNK_SIZE < len(items):
                        await asyncio.sleep(0)
                for logger_ in self.stat_loggers:
                    logger_.maybe_log()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = (
                e
                if isinstance(e, EngineDeadError)
                else EngineDeadError(f"Engine output handler failed: {e!r}")
            )
            self._dead_error = error
            logger.error("The engine died: %s", error)
            # A dead core holds nothing: no gauge may keep showing its last load.
            for rank in range(self.engine_core.num_engines):
                self._record_stats(SchedulerStats(), IterationStats(), rank)
            self.output_processor.propagate_error(error)
            self.queue.clear()

    def _record_stats(
        self, scheduler_stats: SchedulerStats | None, stats: IterationStats, engine_index: int
    ) -> None:
        for logger_ in self.stat_loggers:
            if self.engine_core.num_engines > 1:  # with one core, a logger written for one needs no rank
                logger_.record(scheduler_stats, stats, engine_index)
            else:
                logger_.record(scheduler_stats, stats)

    async def _fail_requests(self, outputs: list[EngineCoreOutput]) -> None:
        """Requests the core ended without a result raise in their streams instead of finishing:
        `QueueTimeoutError` (max_queue_time), `StructuredOutputError` (their grammar failed). A parent's
        other samples are aborted with them."""
        for output in outputs:
            if output.finish_reason == FinishReason.QUEUE_TIMEOUT:
                wait = self.config.scheduler_config.max_queue_time or 0.0
                error: Exception = QueueTimeoutError(
                    f"The request waited over {wait:g} s (max_queue_time) to be scheduled and was "
                    "dropped: the server is overloaded. Retry later."
                )
            elif output.finish_reason == FinishReason.ERROR:
                error = StructuredOutputError(output.error or "The request failed in the engine core.")
            elif output.finish_reason == FinishReason.RANK_DIED:
                error = EngineDeadError(output.error or "The request's data-parallel rank died.")
            else:
                continue
            state = self.output_processor.request_states.get(output.request_id)
            if state is None:  # aborted meanwhile, or a sibling already failed it
                continue
            await self.abort(state.external_id)
            if state.sink is not None:
                state.sink.put(error)

    def shutdown(self) -> None:
        if self._output_handler is not None:
            self._output_handler.cancel()
        self.engine_core.shutdown()
