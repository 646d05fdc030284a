"""What the engine core logs at start-up, against numbers worked out here from the model's files: the
README promises these lines (as vLLM prints them), and deployments are sized by them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from safetensors import safe_open

from llmserve.model_executor.kernels import native
from tests.engine.test_llm_batching import make_llm, runner_of

BLOCK_SIZE = 16  # CacheConfig's default
MAX_MODEL_LEN = 768


def logged(caplog: pytest.LogCaptureFixture, start: str) -> logging.LogRecord:
    """The one record whose message starts with `start`; its args carry the unrounded numbers."""
    records = [r for r in caplog.records if r.getMessage().startswith(start)]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    return records[0]


@pytest.mark.parametrize(
    ("kv_cache_dtype", "kv_bytes", "kv_name"), [("auto", 4, "float32"), ("bfloat16", 2, "bfloat16")]
)
def test_start_up_logs_weights_kv_pool_concurrency_and_kernel_build(
    tiny_llama_hf_dir: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    kv_cache_dtype: str,
    kv_bytes: int,
    kv_name: str,
) -> None:
    """The fp32 model's pool in fp32, or with `--kv-cache-dtype bfloat16` twice the tokens in bf16."""
    monkeypatch.delenv("LLMSERVE_CPU_ISA", raising=False)
    native._load.cache_clear()  # a core process loads (and logs) its build once; this one already may have
    caplog.set_level(logging.INFO, logger="llmserve")
    budget = (8 << 20) + 5000  # no whole number of blocks: the pool is the whole blocks, not the budget
    llm = make_llm(
        tiny_llama_hf_dir, kv_cache_memory=budget, max_model_len=MAX_MODEL_LEN, kv_cache_dtype=kv_cache_dtype
    )
    config = json.loads((tiny_llama_hf_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    try:
        runner = runner_of(llm)
        pool_bytes = sum(t.nbytes for pair in runner.kv_caches for t in pair)
        assert {t.element_size() for pair in runner.kv_caches for t in pair} == {kv_bytes}
        # RoPE tables for the positions a sequence can reach, not the model's whole context
        tables = {tuple(r.cos.shape) for r in runner.model.rotary_embeddings()}
        assert tables == {(MAX_MODEL_LEN, head_dim // 2)}
    finally:
        llm.shutdown()

    block_bytes = (
        2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * BLOCK_SIZE * kv_bytes
    )
    blocks = budget // block_bytes
    tokens = blocks * BLOCK_SIZE
    with safe_open(str(tiny_llama_hf_dir / "model.safetensors"), "pt") as f:
        file_bytes = sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118 (not a dict)

    assert (
        logged(caplog, "Native kernels:").getMessage()
        == f"Native kernels: {native.supported_isas()[0]} build."
    )
    weights = logged(caplog, "Model weights take")
    assert weights.args == (pytest.approx(file_bytes / 2**30),)  # each weight once, as stored
    kv = logged(caplog, "KV cache:")
    assert pool_bytes == blocks * block_bytes
    assert kv.args == (pytest.approx(pool_bytes / 2**30), blocks, BLOCK_SIZE, tokens, kv_name)
    assert kv.getMessage().endswith(f"{blocks} blocks of {BLOCK_SIZE} tokens ({tokens} tokens), {kv_name}.")
    concurrency = logged(caplog, "Maximum concurrency")
    assert concurrency.getMessage() == (
        f"Maximum concurrency for {MAX_MODEL_LEN} tokens per request: {tokens / MAX_MODEL_LEN:.2f}x"
    )
    # the blocks a step at the default token budget (2048) with every sequence (128) can take
    resident, warm_up = logged(caplog, "The first").args, logged(caplog, "Warm-up:").args
    assert isinstance(resident, tuple) and resident[0] == min(blocks, 2048 // BLOCK_SIZE + 128)
    assert isinstance(warm_up, tuple) and warm_up[:3] == (8, 16, 1) and warm_up[4] == 128
    plan = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("Execution plan", "  "))]
    assert plan[:5] == [
        "Execution plan (cpu, float32):",
        "  projections: stored weights in the checkpoint's format, weight_gemm.c at every batch size",
        "  decode attention: paged_attention.c; prefill attention: prefill_attention.c;"
        " sampling's argmax: argmax.c",
        "  decode-only steps: every layer in one decoder_step.c call",
        "  MLP act(gate) * up outside decoder_step.c: gated_activation.c",
    ]


def test_an_unknown_kv_cache_dtype_is_refused_by_name(tiny_llama_hf_dir: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, got 'fp8'"):
        make_llm(tiny_llama_hf_dir, kv_cache_dtype="fp8")


def test_a_bf16_cache_is_refused_under_a_float16_model(tiny_llama_hf_dir: Path) -> None:
    """fp16 to bf16 loses bits and saves none."""
    with pytest.raises(
        ValueError, match="kv_cache_dtype='bfloat16' is for float32 models; this one computes in"
    ):
        make_llm(tiny_llama_hf_dir, dtype="float16", kv_cache_dtype="bfloat16")
