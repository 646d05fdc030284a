"""The pooling runner of an encoder (BERT): whole prompts, packed into one batch, pooled into vectors.

Every scheduled request is a prompt computed whole in this step (the scheduler never splits one for
an encoder), so the step needs no KV cache: token ids and positions are concatenated, the model
attends within each prompt, and each prompt's rows are pooled into its vector. No row is padding.
"""

from __future__ import annotations

import itertools
import logging

import torch

from llmserve.config import ModelConfig
from llmserve.contracts import ModelRunnerOutput, SchedulerOutput
from llmserve.model_executor.device import configure_core_threads, materialize, resolve_device, resolve_dtype
from llmserve.model_executor.execution_plan import ExecutionPlan
from llmserve.model_executor.loader import ModelSource
from llmserve.model_executor.loader.weights import iter_weights
from llmserve.model_executor.models.bert import BertConfig
from llmserve.model_executor.models.registry import encoder_class
from llmserve.model_executor.pooler import Pooler, PoolerConfig, PoolingSpan, vector_bytes
from llmserve.structured_output.bitmask import GrammarBitmask

logger = logging.getLogger(__name__)


class EncoderModelRunner:
    """Owns the encoder and its pooler."""

    def __init__(
        self, model_config: ModelConfig, encoder_config: BertConfig, source: ModelSource, pooler: PoolerConfig
    ) -> None:
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.num_threads = configure_core_threads(model_config.num_threads)
        self.config = encoder_config
        architecture = encoder_config.architecture
        self.plan = ExecutionPlan.decide(model_config, self.device, self.dtype, architecture, encoder=True)
        for line in self.plan.describe():
            logger.info("%s", line)
        logger.info("Pooling: %s%s.", pooler.pooling_type, ", L2-normalised" if pooler.normalize else "")
        with torch.device("meta"):
            model = encoder_class(architecture)(encoder_config)
        model = materialize(model, self.device, self.dtype)
        model.load_weights(iter_weights(source))
        model.prepare_kernels(self.plan)
        self.model = model.eval()
        self.pooler = Pooler(pooler)

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """Every scheduled prompt, whole: its vector (`grammar_bitmask` is the decoders' and always None)."""
        # by length: runs of equal lengths share an attention call (layers/encoder_attention.py)
        batch = sorted(scheduler_output.scheduled, key=lambda s: s.num_new_tokens)
        if not batch:
            return ModelRunnerOutput()
        lengths = [s.num_new_tokens for s in batch]
        # each prompt runs whole in the step that admits it, so every request here is new in it
        pooling = {new.request_id: new.pooling_params for new in scheduler_output.new_requests}
        spans: list[PoolingSpan] = []
        start = 0
        for sched in batch:
            assert sched.num_computed_tokens == 0 and sched.samples  # whole prompts (see the scheduler)
            params = pooling[sched.request_id]
            normalize = None if params is None else params.normalize
            spans.append(PoolingSpan(start, sched.num_new_tokens, normalize))
            start += sched.num_new_tokens
        token_ids = torch.tensor(
            list(itertools.chain.from_iterable(s.token_ids for s in batch)), device=self.device
        )
        counts = torch.tensor(lengths, device=self.device)
        firsts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        positions = torch.arange(start, device=self.device) - firsts
        hidden = self.model(token_ids, positions, lengths)
        vectors = vector_bytes(self.pooler(hidden, spans))
        return ModelRunnerOutput(pooled={s.request_id: v for s, v in zip(batch, vectors)})
