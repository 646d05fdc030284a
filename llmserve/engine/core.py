"""The engine core: schedule → execute → update, one step at a time, independent of any transport."""

from __future__ import annotations

import logging
import time

from llmserve.config import EngineConfig, ResolvedLimits
from llmserve.contracts import (
    EngineCoreOutputs,
    EngineCoreRequest,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from llmserve.engine.heap_reuse import heap_size, reserve_heap
from llmserve.model_executor.device import kv_cache_budget
from llmserve.model_executor.encoder_runner import EncoderModelRunner
from llmserve.model_executor.loader import resolve_model
from llmserve.model_executor.loader.sentence_transformers import load_pooler_config
from llmserve.model_executor.loader.weights import load_model_config
from llmserve.model_executor.model_runner import ModelRunner
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.registry import is_encoder, resolve_runner
from llmserve.sampling_params import SamplingParams
from llmserve.scheduling.kv_cache_manager import KVCacheManager, cdiv
from llmserve.scheduling.request import Request, RequestStatus
from llmserve.scheduling.scheduler import Scheduler
from llmserve.spec_decode.speculator import Speculator
from llmserve.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long a step with nothing to run waits for a compiling grammar: bounds the delay it adds to new
# inputs (the busy loop reads them between steps) while sparing a spin.
_GRAMMAR_WAIT_S = 0.01
# The warm-up's small steps take this share of max_num_seqs (and twice it): enough sequences that what
# each adds to the heap stands out, a small part of a full step's compute.
_WARM_UP_SHARE = 16
# glibc grows the heap this much past what a request needs (M_TOP_PAD), so the second step may fit partly
# in what the first grew: counted as the second step's, what each sequence adds errs high, not low.
_HEAP_PAD = 128 << 10


class EngineCore:
    """Owns the scheduler, the KV cache manager and the model runner."""

    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        source = resolve_model(config.model_config.model)
        arch_config = load_model_config(source)
        runner = resolve_runner(config.model_config.runner, arch_config.architecture)
        encoder = is_encoder(arch_config.architecture)
        model_max, pooler = arch_config.max_position_embeddings, None
        if runner == "pooling":
            pooling = load_pooler_config(source.path if source.format == "hf" else None, encoder)
            model_max, pooler = min(model_max, pooling.max_seq_length or model_max), pooling.pooler
        self.model_runner: ModelRunner | EncoderModelRunner
        if encoder:
            assert not isinstance(arch_config, DecoderConfig) and pooler is not None  # only pooling
            self.model_runner = EncoderModelRunner(config.model_config, arch_config, source, pooler)
            max_model_len = _max_model_len(config.model_config.max_model_len, model_max, None)
            num_blocks, kv_bytes = _bookkeeping_blocks(config), 0
        else:
            assert isinstance(arch_config, DecoderConfig)
            self.model_runner = ModelRunner(
                config.model_config, arch_config, source, pooler, config.cache_config.kv_cache_dtype
            )
            num_blocks, kv_bytes, max_model_len = self._kv_pool(config, model_max)
        # A prompt the model must compute whole (an encoder's, or one pooled by MEAN or CLS) is never
        # split into chunks, so it must fit one step's token budget; nor may it skip cached blocks.
        whole_prompts = encoder or (pooler is not None and pooler.needs_whole_prompt)
        if whole_prompts:
            _check_whole_prompts_fit(max_model_len, config.scheduler_config.max_num_batched_tokens)
        block_size = config.cache_config.block_size
        self.limits = ResolvedLimits(
            max_model_len=max_model_len,
            num_kv_blocks=num_blocks,
            block_size=block_size,
            vocab_size=arch_config.vocab_size,
            runner=runner,
        )
        _log_memory(self.model_runner, self.limits, kv_bytes)
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            block_size,
            config.cache_config.enable_prefix_caching and not whole_prompts,
            sliding_window=arch_config.cache_window,
            resident_blocks=(
                self.model_runner.kv_resident_blocks if isinstance(self.model_runner, ModelRunner) else None
            ),
        )
        speculative = config.speculative_config
        if speculative is not None and runner == "pooling":
            raise ValueError(
                "speculative_config applies to generation; the pooling runner generates no tokens."
            )
        self.scheduler = Scheduler(
            config.scheduler_config,
            self.kv_cache_manager,
            self.limits.max_model_len,
            chunked_prefill=not whole_prompts,
            speculator=None if speculative is None else Speculator(speculative, max_model_len),
        )
        self.structured_output_manager = StructuredOutputManager(
            source, self.limits.vocab_size, config.scheduler_config.max_num_seqs
        )
        self._config, self._started = config, started

    def warm_up(self, heap_kept: bool) -> None:
        """Makes the first request's step as fast as the ones after it, without running a step of the
        configured batch shape (`max_num_seqs` sequences of one token and their guesses; seconds of
        compute on a larger model): two small steps of that shape run every kernel of a decode step
        once, the heap they grow says what each sequence adds to a step's temporaries (activations,
        logits, the sampler's), and where the process keeps what it frees (`heap_reuse.py`, as
        `heap_kept` says) the heap the full step needs is made resident from that.
        """
        pool, config = self.kv_cache_manager.block_pool, self._config
        if self.limits.runner != "generate":
            return
        speculative = config.speculative_config
        rows = 1 + (0 if speculative is None else speculative.num_speculative_tokens)
        per_seq = cdiv(rows, self.limits.block_size)
        num_seqs = min(config.scheduler_config.max_num_seqs, pool.num_free_blocks // per_seq)
        started = time.perf_counter()
        small = max(1, num_seqs // _WARM_UP_SHARE)
        self._warm_up_step(small, rows, per_seq)
        first = heap_size()
        self._warm_up_step(min(2 * small, num_seqs), rows, per_seq)
        second = heap_size()
        reserved = 0
        if heap_kept and first is not None and second is not None and num_seqs > 2 * small:
            reserved = (second - first + _HEAP_PAD) * (num_seqs - 2 * small) // small
            reserve_heap(reserved)
        now = time.perf_counter()
        logger.info(
            "Warm-up: steps of %d and %d sequences (%d rows each), and %.0f MiB of heap resident for a "
            "step of %d, in %.2f s. Engine core ready %.1f s after it started.",
            small,
            min(2 * small, num_seqs),
            rows,
            reserved / (1 << 20),
            num_seqs,
            now - started,
            now - self._started,
        )

    def _warm_up_step(self, num_seqs: int, rows: int, per_seq: int) -> None:
        """One step of `num_seqs` sequences of one token and `rows - 1` guesses, each in blocks of its
        own, given back to the pool after."""
        runner, pool = self.model_runner, self.kv_cache_manager.block_pool
        assert isinstance(runner, ModelRunner)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        blocks = pool.get_new_blocks(num_seqs * per_seq)
        ids = [f"warm-up-{i}" for i in range(num_seqs)]
        scheduled = [
            ScheduledRequest(
                request_id,
                0,
                [0],
                [b.block_id for b in blocks[i * per_seq : (i + 1) * per_seq]],
                samples=True,
                spec_token_ids=[0] * (rows - 1),
            )
            for i, request_id in enumerate(ids)
        ]
        new = [NewRequestData(request_id, [0], params, None) for request_id in ids]
        runner.execute_model(SchedulerOutput(scheduled, new))
        runner.execute_model(SchedulerOutput(finished_request_ids=ids))  # the runner forgets them
        pool.free_blocks(blocks)

    def _kv_pool(self, config: EngineConfig, model_max: int) -> tuple[int, int, int]:
        """A decoder's KV pool, sized from `kv_cache_memory`: its blocks, its bytes, and max_model_len
        (capped by the pool)."""
        runner = self.model_runner
        assert isinstance(runner, ModelRunner)
        block_size = config.cache_config.block_size
        budget = kv_cache_budget(
            runner.device, config.cache_config.kv_cache_memory, config.parallel_config.data_parallel_size
        )
        scheduler = config.scheduler_config
        block_bytes = runner.kv_cache_bytes_per_block(block_size)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory ({budget} bytes) is too small for one KV block of {block_size} tokens."
            )
        max_model_len = _max_model_len(config.model_config.max_model_len, model_max, num_blocks * block_size)
        # resident before the first request: what a step at the token budget with every sequence can take
        first_step = cdiv(scheduler.max_num_batched_tokens, block_size) + scheduler.max_num_seqs
        runner.initialize_kv_cache(num_blocks, block_size, max_model_len, first_step)
        return num_blocks, num_blocks * block_bytes, max_model_len

    def add_request(self, request: EngineCoreRequest) -> None:
        core_request = Request.from_engine_core_request(request, self.limits.max_model_len)
        if core_request.structured_output is not None:
            self.structured_output_manager.grammar_init(core_request)
        self.scheduler.add_request(core_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._forget_finished_when_idle()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:  # perhaps every request waits for its grammar
            self.structured_output_manager.wait_for_grammars(_GRAMMAR_WAIT_S)
        grammar_bitmask = self.structured_output_manager.grammar_bitmask(
            scheduler_output.scheduled, self.scheduler.requests
        )
        runner_output = self.model_runner.execute_model(scheduler_output, grammar_bitmask)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self._forget_finished_when_idle()
        return EngineCoreOutputs(outputs, self.scheduler.make_stats(), time.monotonic())

    def _forget_finished_when_idle(self) -> None:
        """The runner drops a finished request's state when the next step's output names it; with no
        request left there may be no next step for a while, so an empty one names them now."""
        if not self.scheduler.has_unfinished_requests():
            self.model_runner.execute_model(self.scheduler.schedule())


def _bookkeeping_blocks(config: EngineConfig) -> int:
    """An encoder keeps no keys and values; the scheduler still hands out block ids (no memory behind
    them), as many as one step's requests can take: they all finish in the step they run."""
    scheduler = config.scheduler_config
    return cdiv(scheduler.max_num_batched_tokens, config.cache_config.block_size) + scheduler.max_num_seqs


def _check_whole_prompts_fit(max_model_len: int, max_num_batched_tokens: int) -> None:
    """vLLM's rule where prefills are not chunked: the longest prompt must fit one step."""
    if max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than max_model_len "
            f"({max_model_len}): this model computes each prompt whole, in one step (no chunked "
            "prefill). Raise max_num_batched_tokens or lower max_model_len."
        )


def _log_memory(runner: ModelRunner | EncoderModelRunner, limits: ResolvedLimits, kv_bytes: int) -> None:
    """What the engine holds, as vLLM reports it: weights, the KV pool (`kv_bytes`: its whole blocks,
    not the budget they were cut from), and how many requests of the full context length fit in it."""
    tokens = limits.num_kv_blocks * limits.block_size
    logger.info("Model weights take %.2f GiB.", runner.model.weight_bytes() / 2**30)
    if isinstance(runner, EncoderModelRunner):
        logger.info("KV cache: none (an encoder computes each prompt whole, in one step).")
        return
    logger.info(
        "KV cache: %.2f GiB, %d blocks of %d tokens (%d tokens), %s.",
        kv_bytes / 2**30,
        limits.num_kv_blocks,
        limits.block_size,
        tokens,
        str(runner.kv_cache_dtype).removeprefix("torch."),
    )
    logger.info(
        "Maximum concurrency for %d tokens per request: %.2fx",
        limits.max_model_len,
        tokens / limits.max_model_len,
    )


def _max_model_len(requested: int | None, model_max: int, pool_tokens: int | None) -> int:
    """The model's context length, or the requested one (never more), capped by the KV pool if any."""
    if requested is not None and requested > model_max:
        raise ValueError(
            f"max_model_len ({requested}) is larger than the model's context length ({model_max})."
        )
    return min(requested or model_max, pool_tokens or model_max)
