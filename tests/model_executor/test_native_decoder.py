"""Our Llama's logits against the decoder written out here in fp64 (`Fp64Llama`) from gguf's reading of
the same stored weights: decode steps through `decoder_step.c` (NativeDecoder) and through the PyTorch
layers, prefills and chunked prefills through the PyTorch layers, for stored and dense weights. With
int8 activations (`--quantization int8|int4`) the two decode paths are compared with each other.

Tolerance of the fp32 paths: every row's max |logit error| <= 1e-4 x its max |logit| (and 1e-4 for the
K and V written, of magnitude ~1). Each product sums at most 512 fp32 terms (unit roundoff 6e-8) and
three layers compound them; the RoPE tables are fp32 too (an angle near 30 rad is rounded by up to
2e-6). The errors measured stay under 5e-6; a wrong RoPE pairing or position, norm epsilon, attention
scale, bias or head mapping each fails by far more.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

from llmserve.model_executor.attention import AttentionMetadata, PrefillChunk
from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.decoder_layer import KVCache
from llmserve.model_executor.layers.mlp import GatedMLP
from llmserve.model_executor.layers.stored_weight import StoredTensor
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.llama import LlamaForCausalLM
from llmserve.model_executor.native_decoder import NativeDecoder, misfit, op_by_op_layers
from tests.model_executor.fp64_llama import Fp64Llama, Weights
from tests.model_executor.isas import TESTED_ISAS
from tests.model_executor.stored_weights import K_TYPES, Q, cpu_plan, random_stored_tensor

BLOCK_ROWS = native.BLOCK_GEMV_MAX_ROWS

BLOCK_SIZE, NUM_BLOCKS = 4, 200
# Checkpoint shard → GGML type, for a model stored in mixed types as a Q4_K_M file is.
MIXED = {"v_proj": Q.Q6_K, "down_proj": Q.Q6_K, "q_proj": Q.Q4_K, "lm_head": Q.Q6_K}


def tiny_config(attention_bias: bool, tied: bool = True) -> DecoderConfig:
    return DecoderConfig(
        architecture="Qwen2ForCausalLM" if attention_bias else "LlamaForCausalLM",
        vocab_size=96,
        hidden_size=256,  # whole K super-blocks
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        attention_bias=attention_bias,
    )


def checkpoint(config: DecoderConfig) -> dict[str, torch.Tensor]:
    """Random weights under Hugging Face's names."""
    torch.manual_seed(0)
    c = config
    weights = {"model.embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size) * 0.5}
    kv = c.num_key_value_heads * c.head_dim
    shapes = {
        "self_attn.q_proj": (c.num_attention_heads * c.head_dim, c.hidden_size),
        "self_attn.k_proj": (kv, c.hidden_size),
        "self_attn.v_proj": (kv, c.hidden_size),
        "self_attn.o_proj": (c.hidden_size, c.num_attention_heads * c.head_dim),
        "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj": (c.hidden_size, c.intermediate_size),
    }
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for name, shape in shapes.items():
            weights[f"{prefix}{name}.weight"] = torch.randn(shape) / shape[1] ** 0.5
            if c.attention_bias and name[-6:] in ("q_proj", "k_proj", "v_proj"):
                weights[f"{prefix}{name}.bias"] = torch.randn(shape[0]) * 0.5
        for norm in ("input_layernorm", "post_attention_layernorm"):  # not all ones: a mix-up would show
            weights[f"{prefix}{norm}.weight"] = torch.rand(c.hidden_size) + 0.5
    weights["model.norm.weight"] = torch.rand(c.hidden_size) + 0.5
    if not c.tie_word_embeddings:
        weights["lm_head.weight"] = torch.randn(c.vocab_size, c.hidden_size) / c.hidden_size**0.5
    return weights


def stored_checkpoint(config: DecoderConfig, storage: str) -> Weights:
    """The checkpoint with its 2-D weights stored as `storage` says: one GGML type's name for every one,
    "mixed" (`MIXED`, else Q4_K), or "dense" (as fp32 tensors, for a model without stored weights)."""
    weights: Weights = []
    for name, tensor in checkpoint(config).items():
        if tensor.dim() == 2 and storage != "dense":
            shard = name.split(".")[-2]
            qtype = MIXED.get(shard, Q.Q4_K) if storage == "mixed" else Q.__members__[storage]
            if qtype in K_TYPES:  # gguf-py cannot round into these: random bits of the same magnitude
                rows, cols = tensor.shape
                scale = float(tensor.std())
                weights.append((name, random_stored_tensor(qtype, rows, cols, len(weights), scale)))
            elif qtype == Q.F32:
                weights.append((name, StoredTensor.from_dense(tensor)))
            else:
                weights.append((name, StoredTensor.rounded(tensor, qtype)))
        else:
            weights.append((name, tensor))
    return weights


class Loaded(NamedTuple):
    model: LlamaForCausalLM
    decoder: NativeDecoder | None  # its decode steps through decoder_step.c, where the plan has them


def load_model(
    config: DecoderConfig, weights: Weights, quantization: str = "none", op_by_op: tuple[int, ...] = ()
) -> Loaded:
    """The model over these weights, rounded as `quantization` asks, and its fused decode step, as the
    model runner builds them; `op_by_op`: layers the plan leaves to PyTorch within that step."""
    stored = any(isinstance(t, StoredTensor) for _, t in weights)
    model = LlamaForCausalLM(config, stored=stored)
    model.load_weights(weights)
    plan = cpu_plan(quantization, stored)
    if op_by_op:
        plan = plan.with_op_by_op_layers(op_by_op, "a test's choice")
    model.prepare_kernels(plan)
    return Loaded(model.eval(), NativeDecoder(model, plan) if plan.fused_decode else None)


def stored_model(attention_bias: bool, storage: str, quantization: str = "none") -> Loaded:
    config = tiny_config(attention_bias)
    return load_model(config, stored_checkpoint(config, storage), quantization)


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = (actual.double() - expected).abs().amax(-1) / expected.abs().amax(-1)
    assert error.max() < 1e-4, error


def cached(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Positions [0, length) of a sequence from its block table → [length, kv_heads, d]."""
    t = torch.arange(length)
    return cache[:, table[t // BLOCK_SIZE], t % BLOCK_SIZE].transpose(0, 1)


def slots_of(table: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    t = torch.arange(start, stop)
    return table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE


def decode_metadata(lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    """One new token per sequence, at position len - 1 of its block table."""
    return AttentionMetadata(
        slot_mapping=torch.cat([slots_of(table, n - 1, n) for table, n in zip(tables, lens)]),
        num_decodes=len(lens),
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor(lens),
        decode_max_len=max(lens),
        prefills=[],
        native_decode=True,
    )


@dataclass
class DecodeStep:
    """One decode step of random rows over random cache contents, through decoder_step.c (`fast`) and
    through the PyTorch layers (`plain`), each from its own copy of the caches (`before`)."""

    before: list[KVCache]
    lens: list[int]
    tables: torch.Tensor
    meta: AttentionMetadata
    ids: torch.Tensor
    fast: torch.Tensor  # logits
    caches: list[KVCache]
    plain: torch.Tensor
    plain_caches: list[KVCache]


def decode_step_both_ways(
    loaded: Loaded, config: DecoderConfig, rows: int, cache_dtype: torch.dtype
) -> DecodeStep:
    model, decoder = loaded
    assert decoder is not None
    gen = torch.Generator().manual_seed(rows)
    shape = (config.num_key_value_heads, NUM_BLOCKS, BLOCK_SIZE, config.head_dim)
    before = [
        (torch.randn(shape, generator=gen).to(cache_dtype), torch.randn(shape, generator=gen).to(cache_dtype))
        for _ in model.layers
    ]
    lens = [int(n) for n in torch.randint(1, 9 * BLOCK_SIZE, (rows,), generator=gen)]
    lens[0] = 1  # a first token attends only to itself
    # Scattered blocks, no two rows sharing one (each writes its new token's slot).
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[: rows * 9].view(rows, 9)
    meta = decode_metadata(lens, tables)
    ids = torch.randint(0, config.vocab_size, (rows,), generator=gen)
    positions = torch.tensor(lens) - 1
    caches = [(k.clone(), v.clone()) for k, v in before]
    plain_caches = [(k.clone(), v.clone()) for k, v in before]
    fast = logits_of(model, decoder, ids, positions, caches, meta)
    plain = logits_of(model, None, ids, positions, plain_caches, meta)
    return DecodeStep(before, lens, tables, meta, ids, fast, caches, plain, plain_caches)


@pytest.mark.parametrize(
    ("rows", "attention_bias", "storage", "quantization"),
    [
        (1, False, "Q4_1", "none"),  # weight_gemm.c, widening in registers
        (3, True, "Q8_0", "none"),
        (8, False, "Q4_1", "none"),
        (1, False, "F32", "int4"),  # int8 activations: integer products (block_q8.c)
        (5, True, "F32", "int8"),
        (BLOCK_ROWS, True, "F32", "int8"),
        (11, True, "Q8_0", "none"),  # weight_gemm.c's tiles
        (BLOCK_ROWS + 5, False, "F32", "int4"),  # rounded activations into weight_gemm.c
        (1, True, "mixed", "none"),  # K types, parts of different types
        (9, False, "mixed", "none"),
        (2, False, "F16", "none"),
        (4, True, "BF16", "none"),
    ],
)
def test_decode_step_over_a_filled_cache(
    rows: int, attention_bias: bool, storage: str, quantization: str
) -> None:
    """One decode step over random cache contents, through decoder_step.c and through the PyTorch layers:
    the fp64 decoder's logits, and its new K and V in their slots and nowhere else."""
    config = tiny_config(attention_bias)
    weights = stored_checkpoint(config, storage)
    step = decode_step_both_ways(load_model(config, weights, quantization), config, rows, torch.float32)

    before, lens, tables, meta, ids = step.before, step.lens, step.tables, step.meta, step.ids
    fast, caches, plain, plain_caches = step.fast, step.caches, step.plain, step.plain_caches
    shape = before[0][0].shape
    if quantization != "none":  # the paths sum in other orders, and an activation may round a step apart
        pairs = [(fast, plain)] + [
            pair for (k, v), (pk, pv) in zip(caches, plain_caches) for pair in ((k, pk), (v, pv))
        ]
        for a, b in pairs:
            error = (a - b).flatten(0, -2).norm(dim=-1) / b.flatten(0, -2).norm(dim=-1)
            assert error.median() < 1e-5 and error.max() < 5e-2
        return
    ref = Fp64Llama(config, weights)
    expected, new_kv = [], []
    for row, (table, n) in enumerate(zip(tables, lens)):
        past = [(cached(k, table, n - 1), cached(v, table, n - 1)) for k, v in before]
        logits, kv = ref.forward(ids[row : row + 1], n - 1, past)
        expected.append(logits)
        new_kv.append(kv)
    for logits in (fast, plain):
        assert_logits_close(logits, torch.cat(expected))
    for result in (caches, plain_caches):
        for layer, pair in enumerate(result):
            for i, (cache, old) in enumerate(zip(pair, before[layer])):
                flat, old_flat = cache.view(shape[0], -1, shape[-1]), old.view(shape[0], -1, shape[-1])
                written = torch.cat([kv[layer][i] for kv in new_kv]).transpose(0, 1)  # [kv_heads, rows, d]
                torch.testing.assert_close(flat[:, meta.slot_mapping].double(), written, rtol=1e-4, atol=1e-4)
                flat[:, meta.slot_mapping] = old_flat[:, meta.slot_mapping]
                assert torch.equal(cache, old), "a write outside this step's slots"


@pytest.mark.parametrize(("rows", "storage"), [(1, "Q4_1"), (7, "mixed")])
def test_decode_step_into_a_bf16_cache(rows: int, storage: str) -> None:
    """`--kv-cache-dtype bfloat16` under the fp32 model: decoder_step.c rounds the new keys and values as
    PyTorch's write does (to nearest, ties to even), so both paths store the same bits but where their
    fp32 values differ by a rounding, and attend alike to the rounded cache."""
    config = tiny_config(False)
    weights = stored_checkpoint(config, storage)
    step = decode_step_both_ways(load_model(config, weights), config, rows, torch.bfloat16)

    before, lens, tables, meta, ids = step.before, step.lens, step.tables, step.meta, step.ids
    fast, caches, plain, plain_caches = step.fast, step.caches, step.plain, step.plain_caches
    shape = before[0][0].shape
    ref = Fp64Llama(config, weights)
    expected = []
    for row, (table, n) in enumerate(zip(tables, lens)):
        past = [(cached(k, table, n - 1).float(), cached(v, table, n - 1).float()) for k, v in before]
        expected.append(ref.forward(ids[row : row + 1], n - 1, past)[0])
    # the fp64 decoder keeps this step's keys and values unrounded: within their rounding (2^-9) of it
    fp64 = torch.cat(expected)
    for logits, want, tolerance in ((fast, fp64, 5e-2), (plain, fp64, 5e-2), (fast, plain.double(), 1e-3)):
        error = (logits.double() - want).abs().amax(-1) / want.abs().amax(-1)
        assert error.max() < tolerance, error
    same = total = 0
    for (k, v), (pk, pv), (ok, ov) in zip(caches, plain_caches, before):
        for cache, plain_cache, old in ((k, pk, ok), (v, pv, ov)):
            flat = cache.view(shape[0], -1, shape[-1])
            written, plain_written = (
                flat[:, meta.slot_mapping],
                plain_cache.view_as(flat)[:, meta.slot_mapping],
            )
            torch.testing.assert_close(written.float(), plain_written.float(), rtol=2**-7, atol=1e-6)
            same += int((written == plain_written).sum())
            total += written.numel()
            flat[:, meta.slot_mapping] = old.view_as(flat)[:, meta.slot_mapping]
            assert torch.equal(cache, old), "a write outside this step's slots"
    assert same >= 0.99 * total  # truncating instead of rounding would differ in about half


def logits_of(
    model: LlamaForCausalLM,
    decoder: NativeDecoder | None,
    ids: torch.Tensor,
    positions: torch.Tensor,
    caches: list[KVCache],
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The model's logits through `decoder` (a decode step in C), or through its PyTorch forward."""
    with torch.inference_mode():
        if decoder is not None:
            return model.compute_logits(decoder(model.embed(ids), positions, caches, meta))
        return model.compute_logits(model(ids, positions, caches, meta))


def step_metadata(
    step: list[tuple[int, int]], tables: torch.Tensor, native_decode: bool
) -> tuple[AttentionMetadata, list[int]]:
    """One step in which each sequence (row of `tables`) computes its positions [start, stop), laid out
    as the model runner lays out the flat batch: the single tokens (decodes) first, then the prefill
    chunks. Also returns the sequences in that order."""
    decodes = [row for row, (start, stop) in enumerate(step) if stop - start == 1]
    order = decodes + [row for row in range(len(step)) if row not in decodes]
    prefills, query_start = [], len(decodes)
    for row in order[len(decodes) :]:
        start, stop = step[row]
        prefills.append(PrefillChunk(query_start, stop - start, start, tables[row]))
        query_start += stop - start
    meta = AttentionMetadata(
        slot_mapping=torch.cat([slots_of(tables[row], *step[row]) for row in order]),
        num_decodes=len(decodes),
        decode_block_tables=tables[decodes],
        decode_seq_lens=torch.tensor([step[row][1] for row in decodes], dtype=torch.int64),
        decode_max_len=max([step[row][1] for row in decodes], default=0),
        prefills=prefills,
        native_decode=native_decode,
    )
    return meta, order


# (storage, attention_bias, tied); the stored ones under every instruction-set build, for decoder_step.c's
# own code (the dense ones run no C).
SEQUENCE_CASES = [
    ("dense", False, True),
    ("dense", True, False),
    ("F32", True, True),
    ("Q8_0", False, False),  # its own lm_head, stored
    ("mixed", True, True),
    ("BF16", False, True),
]


@pytest.mark.parametrize(
    ("isa", "storage", "attention_bias", "tied"),
    [
        (isa, *case)
        for case in SEQUENCE_CASES
        for isa in (TESTED_ISAS if case[0] != "dense" else TESTED_ISAS[:1])
    ],
)
def test_prefill_chunks_then_decodes(
    monkeypatch: pytest.MonkeyPatch, isa: str, storage: str, attention_bias: bool, tied: bool
) -> None:
    """Two sequences through three steps into an empty cache: a fresh prefill of each, one of them in two
    chunks (the second mid-block, after 13 cached tokens, in a batch with the other's first decode), then
    a decode of both (through decoder_step.c where the weights are stored): every logit the fp64 decoder
    gives for the whole sequences."""
    monkeypatch.setenv("LLMSERVE_CPU_ISA", isa)
    config = tiny_config(attention_bias, tied)
    weights = stored_checkpoint(config, storage)
    model, fused = load_model(config, weights)
    native_decode = storage != "dense"  # as the model runner sets it
    assert (fused is not None) == native_decode
    gen = torch.Generator().manual_seed(len(storage))
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in (30, 12)]
    ref = Fp64Llama(config, weights)
    expected = [ref.forward(seq, 0)[0] for seq in tokens]
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[:20].view(2, 10)
    shape = (config.num_key_value_heads, NUM_BLOCKS, BLOCK_SIZE, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]
    steps = [[(0, 13), (0, 10)], [(13, 29), (10, 11)], [(29, 30), (11, 12)]]
    for number, step in enumerate(steps):
        meta, order = step_metadata(step, tables, native_decode)
        ids = torch.cat([tokens[row][slice(*step[row])] for row in order])
        positions = torch.cat([torch.arange(*step[row]) for row in order])
        want = torch.cat([expected[row][slice(*step[row])] for row in order])
        # The last step both through decoder_step.c and through the layers, each from the same cache.
        decoders = [fused, None] if number == 2 and native_decode else [None]
        for decoder in decoders:
            step_caches = [(k.clone(), v.clone()) for k, v in caches] if len(decoders) > 1 else caches
            assert_logits_close(logits_of(model, decoder, ids, positions, step_caches, meta), want)


@pytest.mark.parametrize("op_by_op", [(0,), (1,), (2,), (0, 2)])
def test_layers_the_plan_leaves_to_pytorch_decode_between_the_c_calls(op_by_op: tuple[int, ...]) -> None:
    """A decode step with some layers through their PyTorch forward and the others through decoder_step.c
    (first, middle, last: the final norm then in PyTorch) gives the logits and cache writes of the step
    through PyTorch alone."""
    config = tiny_config(attention_bias=True)
    weights = stored_checkpoint(config, "Q8_0")
    loaded = load_model(config, weights, op_by_op=op_by_op)
    assert loaded.decoder is not None
    runs = itertools.groupby(range(config.num_hidden_layers), key=lambda i: i in op_by_op)
    assert [run.spec is None for run in loaded.decoder.runs] == [in_pytorch for in_pytorch, _ in runs]

    step = decode_step_both_ways(loaded, config, 5, torch.float32)

    assert_logits_close(step.fast, step.plain.double())
    for (k, v), (pk, pv) in zip(step.caches, step.plain_caches):
        torch.testing.assert_close(k, pk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, pv, rtol=1e-5, atol=1e-5)


def test_a_layer_whose_mlp_the_c_lacks_is_planned_op_by_op() -> None:
    class OpaqueMLP(GatedMLP):  # what an MLP without C code looks like to the plan
        kind = None

    model = stored_model(attention_bias=False, storage="Q8_0").model
    assert op_by_op_layers(model) == () and misfit(model) is None
    model.decoder_layers()[1].parts.mlp.__class__ = OpaqueMLP
    assert op_by_op_layers(model) == (1,) and misfit(model) is None
    for layer in model.decoder_layers():
        layer.parts.mlp.__class__ = OpaqueMLP
    assert misfit(model) == "decoder_step.c computes none of LlamaForCausalLM's MLPs"


def test_steps_with_a_prefill_keep_the_torch_path() -> None:
    decoder = stored_model(False, "F32", "int8").decoder
    assert decoder is not None
    tables = torch.zeros(40, 2, dtype=torch.int64)
    assert decoder.accepts(decode_metadata([1] * 40, tables))
    meta = decode_metadata([1], tables[:1])
    meta.prefills = [PrefillChunk(1, 3, 0, tables[0])]
    assert not decoder.accepts(meta)
    meta = decode_metadata([1], tables[:1])
    meta.native_decode = False
    assert not decoder.accepts(meta)


def test_a_stored_head_writes_sampled_logits_into_one_buffer() -> None:
    """A step's sampled logits reuse the model's buffer (a new tensor would be fresh pages every step)
    and equal the head's product computed on its own; other logits (prompt logprobs' chunks) do not
    grow it."""
    model = stored_model(attention_bias=False, storage="Q8_0", quantization="gguf").model
    assert model.logits_kernel is not None
    hidden = torch.randn(6, model.config.hidden_size)
    first = model.compute_logits(hidden, reuse=True)
    torch.testing.assert_close(first, model.logits_kernel(hidden))
    fewer = model.compute_logits(hidden[:4], reuse=True)
    assert fewer.data_ptr() == first.data_ptr()
    torch.testing.assert_close(fewer, model.logits_kernel(hidden[:4]))
    more = model.compute_logits(torch.randn(9, model.config.hidden_size), reuse=True)
    assert more.shape == (9, model.config.vocab_size)
    chunk = model.compute_logits(torch.randn(20, model.config.hidden_size))
    assert chunk.data_ptr() != more.data_ptr()
    assert model.logits_buffer.shape[0] == 9
