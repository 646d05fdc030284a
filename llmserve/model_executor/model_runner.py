"""One forward pass for whatever the scheduler picked: flatten, run the model, sample the ends."""

from __future__ import annotations

import itertools
import logging
import time
import weakref

import torch

from llmserve.config import KVCacheDtype, ModelConfig
from llmserve.contracts import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, TokenLogprobs
from llmserve.model_executor.attention import AttentionMetadata, PrefillChunk
from llmserve.model_executor.device import configure_core_threads, materialize, resolve_device, resolve_dtype
from llmserve.model_executor.execution_plan import (
    ArgmaxKernel,
    DecodeAttentionKernel,
    ExecutionPlan,
    PrefillAttentionKernel,
)
from llmserve.model_executor.host_memory import empty_pool, populate, populate_in_background
from llmserve.model_executor.input_buffers import InputBuffers
from llmserve.model_executor.kernels import native
from llmserve.model_executor.loader import ModelSource
from llmserve.model_executor.loader.weights import iter_weights
from llmserve.model_executor.logits_processors import (
    CompiledCache,
    apply_logits_processors,
    build_logits_metadata,
)
from llmserve.model_executor.models.causal_lm import KVCache
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.moe_config import MoEConfig
from llmserve.model_executor.models.registry import model_class
from llmserve.model_executor.native_decoder import NativeDecoder, misfit, op_by_op_layers
from llmserve.model_executor.pooler import Pooler, PoolerConfig, PoolingSpan, vector_bytes
from llmserve.model_executor.request_state import CachedRequestState
from llmserve.model_executor.sampler import (
    Argmax,
    SamplingMetadata,
    gather_logprobs,
    sample,
    skip_draws,
    torch_argmax,
)
from llmserve.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask

logger = logging.getLogger(__name__)

_PROMPT_LOGITS_ROWS = 1024  # prompt positions scored per logits matrix, which bounds its memory


class ModelRunner:
    """Owns the model, its KV cache tensors, and the seeded generators of running requests. With a
    `pooler` (the pooling runner) it samples nothing: each request whose prompt a step completes gets
    its pooled final-norm hidden state instead."""

    def __init__(
        self,
        model_config: ModelConfig,
        decoder_config: DecoderConfig,
        source: ModelSource,
        pooler: PoolerConfig | None = None,
        kv_cache_dtype: KVCacheDtype = "auto",
    ):
        self.pooler = None if pooler is None else Pooler(pooler)
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.kv_cache_dtype = (
            self.dtype if kv_cache_dtype == "auto" else resolve_dtype(kv_cache_dtype, self.device)
        )
        if self.kv_cache_dtype != self.dtype and self.dtype != torch.float32:  # fp16 to bf16 would only lose
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} is for float32 models; this one computes in"
                f" {str(self.dtype).removeprefix('torch.')}."
            )
        self.num_threads = configure_core_threads(model_config.num_threads)
        self.config = decoder_config
        model_cls = model_class(decoder_config.architecture)
        self.plan = ExecutionPlan.decide(model_config, self.device, self.dtype, decoder_config.architecture)
        torch.manual_seed(model_config.seed)
        with torch.device("meta"):
            model = model_cls(decoder_config, stored=self.plan.stored_weights)
        model = materialize(model, self.device, self.dtype)  # RoPE tables: see initialize_kv_cache
        model.load_weights(iter_weights(source, stored=self.plan.stored_weights))
        if self.plan.fused_decode and (why := misfit(model)) is not None:
            self.plan = self.plan.without_fused_decode(why)
        elif self.plan.fused_decode and (layers := op_by_op_layers(model)):
            self.plan = self.plan.with_op_by_op_layers(layers, "decoder_step.c lacks their MLPs' kind")
        for line in self.plan.describe():
            logger.info("%s", line)
        total, active = model.parameter_counts()
        experts = f"; {decoder_config.describe()}" if isinstance(decoder_config, MoEConfig) else ""
        logger.info("Parameters: %.3gB, %.3gB read per token%s", total / 1e9, active / 1e9, experts)
        model.prepare_kernels(self.plan)
        self.model = model.eval()
        # decode-only steps through decoder_step.c, where the plan says so (`_forward`)
        self.native_decoder = NativeDecoder(model, self.plan) if self.plan.fused_decode else None
        self.kv_caches: list[KVCache] = []
        self.block_size = 0
        self.resident_blocks = 0
        self.inputs = InputBuffers()
        self._generators: dict[str, torch.Generator] = {}
        self.requests: dict[str, CachedRequestState] = {}  # every request the scheduler runs, by id
        self.logits_cache: CompiledCache = weakref.WeakKeyDictionary()  # an entry dies with its request
        self._argmax: Argmax = native.argmax_rows if self.plan.argmax is ArgmaxKernel.C else torch_argmax

    @property
    def native(self) -> bool:
        """Decode attention reads the cache in C, which also takes a cache never cleared."""
        return self.plan.decode_attention is DecodeAttentionKernel.C

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim
        return per_token * block_size * self.kv_cache_dtype.itemsize

    def initialize_kv_cache(
        self, num_blocks: int, block_size: int, max_model_len: int, resident_first: int
    ) -> None:
        """The KV pool, and the RoPE tables for the positions a sequence can reach. The first
        `resident_first` blocks are resident when this returns, the rest soon after (host_memory.py)."""
        for rotary in self.model.rotary_embeddings():
            rotary.compute_tables(max_model_len)
        c = self.config
        shape = (c.num_key_value_heads, num_blocks, block_size, c.head_dim)  # head-major: see attention.py
        self.block_size = block_size

        # The C kernel reads only written slots, so its cache needs no clearing, only faulting in
        # (host_memory.py). The PyTorch path reads padding too, masked out; that must not be NaN, so its
        # cache starts at zero.
        def allocate() -> torch.Tensor:
            if self.native:
                return empty_pool(shape, self.kv_cache_dtype)
            return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

        self.kv_caches = [(allocate(), allocate()) for _ in range(c.num_hidden_layers)]
        self.resident_blocks = num_blocks
        if self.native:
            tensors = [t for pair in self.kv_caches for t in pair]
            started, head = time.perf_counter(), min(resident_first, num_blocks)
            if populate(tensors, range(head)):
                self.resident_blocks = head
                logger.info(
                    "The first %d KV blocks made resident in %.2f s; the rest come in the background.",
                    head,
                    time.perf_counter() - started,
                )
                populate_in_background(tensors, range(head, num_blocks), self._blocks_resident)
            else:
                logger.info("KV cache pages come as they are first written (no MADV_POPULATE_WRITE here).")

    def _blocks_resident(self, n: int) -> None:
        """Called by the populate thread; the block pool reads `resident_blocks` (one int's store and
        load: no lock)."""
        self.resident_blocks = n

    def kv_resident_blocks(self) -> int:
        """How many KV blocks, from the first, have their memory resident (see `BlockPool`)."""
        return self.resident_blocks

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        """`grammar_bitmask`: the tokens this step's structured requests may sample."""
        for request_id in scheduler_output.finished_request_ids:
            self._generators.pop(request_id, None)
            self.requests.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.requests[new.request_id] = CachedRequestState.from_new(new)
        if not scheduler_output.scheduled:
            return ModelRunnerOutput()
        # Decode rows first: they are attended together as one batched decode.
        batch = sorted(scheduler_output.scheduled, key=lambda s: not _decodes(s))
        input_ids, positions, meta, sample_rows = self._prepare_inputs(batch)
        hidden = self._forward(input_ids, positions, meta)
        if self.pooler is not None:
            return ModelRunnerOutput(pooled=self._pool(batch, hidden, self.pooler))
        output = ModelRunnerOutput()
        if any(self.requests[s.request_id].sampling_params.prompt_logprobs is not None for s in batch):
            output.prompt_logprobs = self._prompt_logprobs(batch, hidden)
        if sample_rows:
            sampling = [s for s in batch if s.samples]
            rows = torch.tensor(sample_rows, device=self.device)
            self._sample(sampling, hidden[rows], output, grammar_bitmask)
        return output

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states after the final norm: a decode-only step through the fused decode step where the
        plan has one, any other through the model's PyTorch forward."""
        if self.native_decoder is not None and self.native_decoder.accepts(meta):
            return self.native_decoder(self.model.embed(input_ids), positions, self.kv_caches, meta)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _sample(
        self,
        sampling: list[ScheduledRequest],
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
        grammar_bitmask: GrammarBitmask | None,
    ) -> None:
        """Sample every row of `hidden`: one per request, or with guesses one per guess and one after
        them, each as without guesses, from the request's state before them (the scheduler guesses only
        for requests whose processing allows it). A request keeps its guesses up to the first that
        differs from its row's sample, and that sample (or the one after the last guess): for a guess
        made with certainty this is vLLM's rejection rule, and every kept token is the one the request
        would have sampled in a step of its own, with the same draws of a seeded generator. Tokens come
        from the processed logits; logprobs from the raw ones, after the grammar bitmask (as vLLM's: a
        token the grammar forbids has logprob -inf)."""
        logits = self.model.compute_logits(hidden, reuse=True)  # [rows, vocab] fp32
        counts = [1 + len(s.spec_token_ids) for s in sampling]
        first = list(itertools.accumulate(counts, initial=0))
        requests = [self.requests[s.request_id] for s in sampling]
        row_requests = [r for r, n in zip(requests, counts) for _ in range(n)]
        if grammar_bitmask is not None:
            apply_grammar_bitmask(logits, [r.request_id for r in row_requests], grammar_bitmask)
        processing = build_logits_metadata(row_requests, logits.shape[-1], self.device, self.logits_cache)
        processed = logits if processing is None else apply_logits_processors(logits, processing)
        metadata = self._sampling_metadata(row_requests)
        # seeded requests with guesses: their generator before the step, rewound past the kept rows after
        rewind = {
            i: (generator, generator.get_state())
            for i, s in enumerate(sampling)
            if s.spec_token_ids and (generator := metadata.generators.get(first[i])) is not None
        }
        sampled = sample(processed, metadata, self._argmax)
        row_tokens = sampled.tolist()
        kept = [
            _num_kept(row_tokens[start : start + n], s.spec_token_ids)
            for s, start, n in zip(sampling, first, counts)
        ]
        for i, (generator, state) in rewind.items():
            generator.set_state(state)
            skip_draws(generator, kept[i], processed.shape[-1])
        ids = [s.request_id for s in sampling]
        for request, start, n in zip(requests, first, kept):
            tokens = row_tokens[start : start + n]
            output.sampled_token_ids[request.request_id] = tokens
            request.all_token_ids.extend(tokens)  # as the scheduler appends them, unless they stop it
        wanted = [(i, k) for i, r in enumerate(requests) if (k := r.sampling_params.logprobs) is not None]
        if wanted:
            rows = [first[i] + j for i, _ in wanted for j in range(kept[i])]
            ks = [self.config.vocab_size if k == -1 else k for i, k in wanted for _ in range(kept[i])]
            index = torch.tensor(rows, device=self.device)
            entries = iter(gather_logprobs(logits[index], sampled[index], ks))
            output.logprobs = {ids[i]: list(itertools.islice(entries, kept[i])) for i, _ in wanted}

    def _pool(self, batch: list[ScheduledRequest], hidden: torch.Tensor, pooler: Pooler) -> dict[str, bytes]:
        """The vectors of the requests whose prompts this step completed; a chunk's span is its own
        rows (a pooler that reads more than the last row gets whole prompts: see the scheduler)."""
        spans: list[PoolingSpan] = []
        ids: list[str] = []
        start = 0
        for sched in batch:
            params = self.requests[sched.request_id].pooling_params
            if sched.samples and params is not None:
                spans.append(PoolingSpan(start, sched.num_new_tokens, params.normalize))
                ids.append(sched.request_id)
            start += sched.num_new_tokens
        return dict(zip(ids, vector_bytes(pooler(hidden, spans)))) if spans else {}

    def _prompt_logprobs(
        self, batch: list[ScheduledRequest], hidden: torch.Tensor
    ) -> dict[str, list[TokenLogprobs]]:
        """Score the prompt positions this step computed for the first time, for the requests that
        asked. Hidden state i scores prompt token i + 1, which may lie in a later chunk."""
        indices: list[torch.Tensor] = []
        targets: list[int] = []
        ks: list[int] = []
        owners: list[tuple[str, int]] = []
        query_start = 0
        for sched in batch:
            request = self.requests[sched.request_id]
            k = request.sampling_params.prompt_logprobs
            start = sched.num_computed_tokens
            first = max(start, request.num_prompt_logprobs)  # skip what a preempted run already scored
            end = min(start + sched.num_new_tokens, request.num_prompt_tokens - 1)
            if k is not None and first < end:
                indices.append(torch.arange(query_start + first - start, query_start + end - start))
                targets.extend(request.prompt_token_ids[first + 1 : end + 1])
                ks.extend([self.config.vocab_size if k == -1 else k] * (end - first))
                owners.append((request.request_id, end - first))
                request.num_prompt_logprobs = end
            query_start += sched.num_new_tokens
        if not owners:
            return {}
        flat = torch.cat(indices).to(self.device)
        target = torch.tensor(targets, dtype=torch.int64, device=self.device)
        entries: list[TokenLogprobs] = []
        for i in range(0, len(targets), _PROMPT_LOGITS_ROWS):
            rows = slice(i, i + _PROMPT_LOGITS_ROWS)
            logits = self.model.compute_logits(hidden[flat[rows]])
            entries.extend(gather_logprobs(logits, target[rows], ks[rows]))
        bounds = itertools.accumulate(count for _, count in owners)
        return {request_id: entries[stop - count : stop] for (request_id, count), stop in zip(owners, bounds)}

    def _prepare_inputs(
        self, batch: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat token ids and positions, attention metadata, and the rows that sample: each sampling
        request's last token, or that and its guesses."""
        bs, buffers = self.block_size, self.inputs
        decodes = [s for s in batch if _decodes(s)]  # first in the batch (see execute_model)
        num_decode_rows = sum(s.num_new_tokens for s in decodes)
        buffers.reserve(
            sum(s.num_new_tokens for s in batch),
            num_decode_rows,
            max((len(s.block_ids) for s in decodes), default=0),
        )
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        at = 0
        for sched in batch:
            n, guesses, start = sched.num_new_tokens, sched.spec_token_ids, sched.num_computed_tokens
            tokens = sched.token_ids + guesses
            buffers.write_tokens(at, tokens, start, sched.block_ids, bs)
            if _decodes(sched):
                # A guess is one more decode row of its sequence, seeing the keys up to its own.
                buffers.write_decodes(at, n, sched.block_ids, start + 1)
            else:
                table = torch.tensor(sched.block_ids, dtype=torch.int64, device=self.device)
                prefills.append(PrefillChunk(at, n, start, table))
            at += n
            if sched.samples:
                sample_rows.extend(range(at - 1 - len(guesses), at))
        meta = AttentionMetadata(
            slot_mapping=buffers.slots[:at].to(self.device),
            num_decodes=num_decode_rows,
            decode_block_tables=buffers.decode_tables[:num_decode_rows].to(self.device),
            decode_seq_lens=buffers.decode_lens[:num_decode_rows].to(self.device),
            decode_max_len=max((s.num_computed_tokens + s.num_new_tokens for s in decodes), default=0),
            prefills=prefills,
            native_decode=self.native,
            native_prefill=self.plan.prefill_attention is PrefillAttentionKernel.C,
        )
        token_ids, positions = buffers.token_ids[:at].to(self.device), buffers.positions[:at].to(self.device)
        return token_ids, positions, meta, sample_rows

    def _sampling_metadata(self, rows: list[CachedRequestState]) -> SamplingMetadata:
        """Each row's settings: its request's (a request with guesses has several rows)."""
        params = [r.sampling_params for r in rows]
        vocab = self.config.vocab_size
        temperature = [0.0 if p.greedy else p.temperature for p in params]
        generators: dict[int, torch.Generator] = {}
        for row, (request, p) in enumerate(zip(rows, params)):
            if p.seed is not None and not p.greedy:
                generators[row] = self._generator(request.request_id, p.seed)

        def column(values: list[float], neutral: float, dtype: torch.dtype) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=self.device)

        return SamplingMetadata(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=self.device),
            all_greedy=all(t == 0.0 for t in temperature),
            top_k=column([p.top_k if p.top_k > 0 else vocab for p in params], vocab, torch.int64),
            top_p=column([p.top_p for p in params], 1.0, torch.float32),
            min_p=column([p.min_p for p in params], 0.0, torch.float32),
            generators=generators,
        )

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request_id] = generator
        return generator


def _num_kept(row_tokens: list[int], guesses: list[int]) -> int:
    """How many of a request's sampled rows it keeps: those whose guess its sample confirmed, and the
    first that did not (or the row after the last guess)."""
    for n, (token, guess) in enumerate(zip(row_tokens, guesses), 1):
        if token != guess:
            return n
    return len(guesses) + 1


def _decodes(sched: ScheduledRequest) -> bool:
    """Whether the scheduled tokens are decode rows: one token, or one and its guesses."""
    return sched.num_new_tokens == 1 or bool(sched.spec_token_ids)
