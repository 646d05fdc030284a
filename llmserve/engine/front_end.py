"""What both entry points (`LLMEngine`, `AsyncLLM`) set up before their first request."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from llmserve.config import EngineConfig, ResolvedLimits
from llmserve.engine.core_client import EngineCoreClient, InprocClient
from llmserve.engine.dp_client import DPLBAsyncMPClient, DPSyncMPClient
from llmserve.engine.input_processor import InputProcessor
from llmserve.engine.mp_client import AsyncMPClient, SyncMPClient
from llmserve.engine.output_processor import OutputProcessor
from llmserve.model_executor.loader import load_tokenizer, resolve_model
from llmserve.model_executor.loader.tokenizer import eos_token_ids


@dataclass
class FrontEnd:
    """The tokenizer, the started engine core client, and the processors on either side of it."""

    tokenizer: PreTrainedTokenizerBase
    engine_core: EngineCoreClient
    input_processor: InputProcessor
    output_processor: OutputProcessor

    @property
    def limits(self) -> ResolvedLimits:
        return self.engine_core.limits

    @classmethod
    def start(cls, config: EngineConfig, asyncio_mode: bool) -> FrontEnd:
        source = resolve_model(config.model_config.model)
        # The tokenizer loads while the engine core starts (a second or two off the start-up).
        with ThreadPoolExecutor(1, thread_name_prefix="load-tokenizer") as pool:
            loading = pool.submit(load_tokenizer, source, config.model_config.chat_template)
            engine_core = make_client(config, asyncio_mode)
            tokenizer = loading.result()
        input_processor = InputProcessor(
            tokenizer,
            engine_core.limits,
            eos_token_ids(source, tokenizer),
            config.model_config.max_logprobs,
            config.structured_outputs_config,
        )
        return cls(tokenizer, engine_core, input_processor, OutputProcessor(tokenizer))


def make_client(config: EngineConfig, asyncio_mode: bool) -> EngineCoreClient:
    """`SyncMPClient` or `AsyncMPClient`; `InprocClient` when `config.multiprocess` is off; their data-
    parallel forms for more than one rank. The asyncio engine has no in-process form: a step would block
    its event loop, so that combination is refused."""
    parallel = config.parallel_config
    if parallel.data_parallel_size > 1 or parallel.data_parallel_backend == "ray":
        if not config.multiprocess:
            raise ValueError("data_parallel_size > 1 needs multiprocess=True: each rank is a process.")
        return DPLBAsyncMPClient(config) if asyncio_mode else DPSyncMPClient(config)
    if not config.multiprocess:
        if asyncio_mode:
            raise ValueError(
                "multiprocess=False is not supported by the asyncio engine: its engine core runs in its "
                "own process, so that steps never block the event loop."
            )
        return InprocClient(config)
    return AsyncMPClient(config) if asyncio_mode else SyncMPClient(config)
