"""A decode step through `decoder_step.c` computes what the PyTorch layers compute, cache writes included."""

from __future__ import annotations

import pytest
import torch

from llmserve.model_executor.attention import AttentionMetadata, PrefillChunk
from llmserve.model_executor.layers.linear import BLOCK_ROWS, StoredKernel
from llmserve.model_executor.layers.stored_weight import StoredTensor
from llmserve.model_executor.models.llama import KVCache, LlamaForCausalLM
from llmserve.model_executor.models.llama_config import LlamaConfig
from llmserve.model_executor.models.native_decoder import NativeDecoder
from tests.model_executor.stored_weights import K_TYPES, Q, random_stored_tensor

BLOCK_SIZE, NUM_BLOCKS = 4, 200
# Checkpoint shard → GGML type, for a model stored in mixed types as a Q4_K_M file is.
MIXED = {"v_proj": Q.Q6_K, "down_proj": Q.Q6_K, "q_proj": Q.Q4_K, "lm_head": Q.Q6_K}


def tiny_config(attention_bias: bool) -> LlamaConfig:
    return LlamaConfig(
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
        tie_word_embeddings=True,
        attention_bias=attention_bias,
    )


def checkpoint(config: LlamaConfig) -> dict[str, torch.Tensor]:
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
    return weights


def stored_model(attention_bias: bool, storage: str, quantization: str = "none") -> LlamaForCausalLM:
    """A tiny random Llama keeping its 2-D weights as `storage` says: one GGML type's name for every
    one, or "mixed" (`MIXED`, else Q4_K); then rounded as `quantization` asks, as the model runner does."""
    config = tiny_config(attention_bias)
    weights = []
    for name, tensor in checkpoint(config).items():
        if tensor.dim() == 2:
            shard = name.split(".")[-2]
            qtype = MIXED.get(shard, Q.Q4_K) if storage == "mixed" else Q[storage]
            if qtype in K_TYPES:  # gguf-py cannot round into these: random bits of the same magnitude
                scale = float(tensor.std())
                tensor = random_stored_tensor(qtype, tensor.shape[0], tensor.shape[1], len(weights), scale)
            elif qtype == Q.F32:
                tensor = StoredTensor.from_dense(tensor)
            else:
                tensor = StoredTensor.rounded(tensor, qtype)
        weights.append((name, tensor))
    model = LlamaForCausalLM(config, stored=True)
    model.load_weights(weights)
    model.prepare_kernels(quantization)  # type: ignore[arg-type]
    return model.eval()


def decode_metadata(lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    """One new token per sequence, at position len - 1 of its block table."""
    slots = [
        int(tables[row, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
        for row, n in enumerate(lens)
    ]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decodes=len(lens),
        decode_block_tables=tables,
        decode_seq_lens=torch.tensor(lens),
        decode_max_len=max(lens),
        prefills=[],
        native_decode=True,
    )


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
def test_native_decoder_matches_the_torch_layers(
    rows: int, attention_bias: bool, storage: str, quantization: str
) -> None:
    model = stored_model(attention_bias, storage, quantization)
    assert model.native_decoder is not None
    c = model.config
    gen = torch.Generator().manual_seed(rows)
    shape = (c.num_key_value_heads, NUM_BLOCKS, BLOCK_SIZE, c.head_dim)
    caches: list[KVCache] = [
        (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in model.layers
    ]
    lens = [int(n) for n in torch.randint(1, 9 * BLOCK_SIZE, (rows,), generator=gen)]
    lens[0] = 1  # a first token attends only to itself
    # Scattered blocks, no two rows sharing one (each writes its new token's slot).
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[: rows * 9].view(rows, 9)
    meta = decode_metadata(lens, tables)
    ids = torch.randint(0, c.vocab_size, (rows,), generator=gen)
    positions = torch.tensor(lens) - 1
    plain_caches = [(k.clone(), v.clone()) for k, v in caches]

    with torch.inference_mode():
        fast = model(ids, positions, caches, meta)
        fused, model.native_decoder = model.native_decoder, None
        plain = model(ids, positions, plain_caches, meta)
        model.native_decoder = fused

    if quantization == "none":
        torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
        for (k, v), (pk, pv) in zip(caches, plain_caches):
            torch.testing.assert_close(k, pk, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, pv, rtol=1e-5, atol=1e-5)
    else:  # the paths sum in other orders, and now and then an activation rounds to the next int8 step
        pairs = [(fast, plain)] + [
            pair for (k, v), (pk, pv) in zip(caches, plain_caches) for pair in ((k, pk), (v, pv))
        ]
        for a, b in pairs:
            error = (a - b).flatten(0, -2).norm(dim=-1) / b.flatten(0, -2).norm(dim=-1)
            assert error.median() < 1e-5 and error.max() < 5e-2


def test_steps_with_a_prefill_keep_the_torch_path() -> None:
    decoder = stored_model(False, "F32", "int8").native_decoder
    assert decoder is not None
    tables = torch.zeros(40, 2, dtype=torch.int64)
    assert decoder.accepts(decode_metadata([1] * 40, tables))
    meta = decode_metadata([1], tables[:1])
    meta.prefills = [PrefillChunk(1, 3, 0, tables[0])]
    assert not decoder.accepts(meta)
    meta = decode_metadata([1], tables[:1])
    meta.native_decode = False
    assert not decoder.accepts(meta)


def test_only_a_model_stored_alike_by_every_projection_gets_one() -> None:
    model = stored_model(False, "Q4_1")
    assert NativeDecoder.applies_to(model)
    assert NativeDecoder(model).spec.block_rows == 0  # fp32 activations: weight_gemm.c at every size
    assert NativeDecoder(stored_model(False, "F32", "int4")).spec.block_rows == BLOCK_ROWS
    down = model.layers[1].mlp.down_proj
    down.kernel = lambda x: x  # one projection without a stored weight
    assert not NativeDecoder.applies_to(model)
    model = stored_model(False, "F32", "int8")
    kernel = model.layers[0].mlp.down_proj.kernel
    assert isinstance(kernel, StoredKernel)
    kernel.int8_activations = False  # activations rounded in all projections but one
    assert not NativeDecoder.applies_to(model)
