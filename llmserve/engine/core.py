"""The engine core: schedule → execute → update, one step at a time, independent of any transport."""

from __future__ import annotations

import logging
import time

from llmserve.config import EngineConfig, ResolvedLimits
from llmserve.engine.messages import EngineCoreOutputs, EngineCoreRequest
from llmserve.model_executor.device import kv_cache_budget
from llmserve.model_executor.loader import load_model_config, resolve_model
from llmserve.model_executor.model_runner import ModelRunner
from llmserve.scheduling.kv_cache_manager import KVCacheManager
from llmserve.scheduling.request import Request, RequestStatus
from llmserve.scheduling.scheduler import Scheduler
from llmserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a compiling grammar: bounds the delay it adds to new
# inputs (the busy loop reads them between steps) while sparing a spin.
_GRAMMAR_WAIT_S = 0.01


class EngineCore:
    """Owns the scheduler, the KV cache manager and the model runner."""

    def __init__(self, config: EngineConfig) -> None:
        source = resolve_model(config.model_config.model)
        decoder_config = load_model_config(source)
        self.model_runner = ModelRunner(config.model_config, decoder_config, source)
        block_size = config.cache_config.block_size
        budget = kv_cache_budget(self.model_runner.device, config.cache_config.kv_cache_memory)
        block_bytes = self.model_runner.kv_cache_bytes_per_block(block_size)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory ({budget} bytes) is too small for one KV block of {block_size} tokens."
            )
        self.limits = ResolvedLimits(
            max_model_len=_max_model_len(
                config.model_config.max_model_len,
                decoder_config.max_position_embeddings,
                num_blocks * block_size,
            ),
            num_kv_blocks=num_blocks,
            block_size=block_size,
            vocab_size=decoder_config.vocab_size,
        )
        self.model_runner.initialize_kv_cache(num_blocks, block_size, self.limits.max_model_len)
        _log_memory(self.model_runner, self.limits, num_blocks * block_bytes)
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            block_size,
            config.cache_config.enable_prefix_caching,
            sliding_window=self.model_runner.config.cache_window,
        )
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager, self.limits.max_model_len)
        self.structured_output_manager = StructuredOutputManager(
            source, self.limits.vocab_size, config.scheduler_config.max_num_seqs
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        core_request = Request.from_engine_core_request(request, self.limits.max_model_len)
        if core_request.structured_output is not None:
            self.structured_output_manager.grammar_init(core_request)
        self.scheduler.add_request(core_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:  # perhaps every request waits for its grammar
            self.structured_output_manager.wait_for_grammars(_GRAMMAR_WAIT_S)
        grammar_bitmask = self.structured_output_manager.grammar_bitmask(scheduler_output.scheduled)
        runner_output = self.model_runner.execute_model(scheduler_output, grammar_bitmask)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(outputs, self.scheduler.make_stats(), time.monotonic())


def _log_memory(runner: ModelRunner, limits: ResolvedLimits, kv_bytes: int) -> None:
    """What the engine holds, as vLLM reports it: weights, the KV pool (`kv_bytes`: its whole blocks,
    not the budget they were cut from), and how many requests of the full context length fit in it."""
    tokens = limits.num_kv_blocks * limits.block_size
    logger.info("Model weights take %.2f GiB.", runner.model.weight_bytes() / 2**30)
    logger.info(
        "KV cache: %.2f GiB, %d blocks of %d tokens (%d tokens).",
        kv_bytes / 2**30,
        limits.num_kv_blocks,
        limits.block_size,
        tokens,
    )
    logger.info(
        "Maximum concurrency for %d tokens per request: %.2fx",
        limits.max_model_len,
        tokens / limits.max_model_len,
    )


def _max_model_len(requested: int | None, model_max: int, pool_tokens: int) -> int:
    """The model's context length, or the requested one (never more), capped by the KV pool."""
    if requested is not None and requested > model_max:
        raise ValueError(
            f"max_model_len ({requested}) is larger than the model's context length ({model_max})."
        )
    return min(requested or model_max, pool_tokens)
