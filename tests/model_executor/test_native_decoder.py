"""A decode step through `decoder_step.c` computes what the PyTorch layers compute, cache writes included."""

from __future__ import annotations

import pytest
import torch

from llmserve.model_executor.attention import AttentionMetadata, PrefillChunk
from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.linear import BLOCK_ROWS, BlockKernel, OneDNNKernel
from llmserve.model_executor.models.llama import KVCache, LlamaForCausalLM
from llmserve.model_executor.models.llama_config import LlamaConfig
from llmserve.model_executor.models.native_decoder import NativeDecoder
from llmserve.model_executor.quantization import round_to_blocks

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no C compiler here")

BLOCK_SIZE, NUM_BLOCKS = 4, 200


def block_model(attention_bias: bool, quantization: str, int8_activations: bool = False) -> LlamaForCausalLM:
    """A tiny random Llama whose projections read blocks (quantization int8|int4), or only packed fp32
    weights (quantization "none")."""
    config = LlamaConfig(
        architecture="Qwen2ForCausalLM" if attention_bias else "LlamaForCausalLM",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attention_bias=attention_bias,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # not all ones, so a norm weight mixed up would show
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.5)
    if quantization == "none":
        model.prepare_kernels("none", native_kernels=True)
        return model.eval()
    rounded = round_to_blocks(model, quantization)  # as the model runner does it
    model.prepare_kernels(quantization, native_kernels=True)  # type: ignore[arg-type]
    model.attach_blocks(rounded, int8_activations)
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
    ("rows", "attention_bias", "quantization", "int8_activations"),
    [
        (1, False, "int4", False),
        (3, True, "int8", False),
        (BLOCK_ROWS, False, "int8", False),
        (1, False, "int4", True),
        (5, True, "int8", True),
        (BLOCK_ROWS + 3, True, "int8", False),  # more rows than the blocks take: the packed weights
        (BLOCK_ROWS + 12, False, "int4", True),
        (1, True, "none", False),  # no blocks: the packed weights at every size
        (BLOCK_ROWS + 1, False, "none", False),
    ],
)
def test_native_decoder_matches_the_torch_layers(
    rows: int, attention_bias: bool, quantization: str, int8_activations: bool
) -> None:
    model = block_model(attention_bias, quantization, int8_activations)
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

    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
    for (k, v), (pk, pv) in zip(caches, plain_caches):
        torch.testing.assert_close(k, pk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, pv, rtol=1e-5, atol=1e-5)


def test_steps_with_a_prefill_keep_the_torch_path() -> None:
    decoder = block_model(False, "int8").native_decoder
    assert decoder is not None
    tables = torch.zeros(40, 2, dtype=torch.int64)
    assert decoder.accepts(decode_metadata([1] * 40, tables))
    meta = decode_metadata([1], tables[:1])
    meta.prefills = [PrefillChunk(1, 3, 0, tables[0])]
    assert not decoder.accepts(meta)
    meta = decode_metadata([1], tables[:1])
    meta.native_decode = False
    assert not decoder.accepts(meta)


def test_only_a_model_read_alike_by_every_projection_gets_one() -> None:
    model = block_model(False, "int8")
    assert NativeDecoder.applies_to(model)
    down = model.layers[1].mlp.down_proj
    assert isinstance(down.kernel, BlockKernel)
    down.kernel = down.kernel.large  # one projection without blocks
    assert not NativeDecoder.applies_to(model)
    model = block_model(False, "none")
    assert NativeDecoder.applies_to(model)
    down = model.layers[1].mlp.down_proj
    down.kernel = OneDNNKernel(torch.randn(down.out_features, down.in_features), None)
    assert not NativeDecoder.applies_to(model)  # one projection not packed
    model = block_model(False, "int8")
    model.layers[0].mlp.down_proj.kernel.int8_activations = True  # type: ignore[union-attr]
    assert not NativeDecoder.applies_to(model)  # activations rounded in one projection only
