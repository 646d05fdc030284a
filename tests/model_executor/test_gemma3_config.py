"""Gemma 3's config from both checkpoint formats, its GGUF weights, and a tiny random Gemma 3 against
`transformers`.

The tiny model has every part that differs from Llama set away from its neutral value: (1 + w) norms
with w drawn around zero, head_dim unlike hidden / heads, a query_pre_attn_scalar unlike head_dim, a
final logit cap the logits reach, distinct local and global RoPE bases, and a sliding window shorter
than the longer prompt; so a part computed as Llama would compute it changes the greedy tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from safetensors.torch import load_file

from llmserve import LLM, SamplingParams
from llmserve.model_executor.loader import ModelSource
from llmserve.model_executor.loader.gguf_file import read_gguf_header
from llmserve.model_executor.loader.weights import iter_weights, load_model_config
from llmserve.model_executor.models.gemma3 import (
    FULL,
    GEMMA3_GGUF_LAYER_NAMES,
    SLIDING,
    Gemma3Config,
    Gemma3ForCausalLM,
)
from tests.e2e.greedy_reference import assert_matches_hf, assert_top_logprobs_match, hf_greedy
from tests.engine.test_llm_batching import core_of, count_native_steps
from tests.fixtures.tiny_llama import VOCAB_SIZE, add_shape_keys, build_tokenizer

WINDOW = 8
LAYER_TYPES = [SLIDING, FULL, SLIDING]
NUM_TOKENS = 12
PROMPT_LENGTHS = (5, 30)  # within the window, and well past it


def tiny_gemma3_config() -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=20,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        final_logit_softcapping=3.0,
        max_position_embeddings=256,
        rope_parameters={
            FULL: {"rope_type": "default", "rope_theta": 50_000.0},
            SLIDING: {"rope_type": "default", "rope_theta": 300.0},
        },
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def write_tiny_gemma3(folder: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(tiny_gemma3_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # w around 0: (1 + w) and w differ everywhere
                param.uniform_(-0.5, 0.5)
            param.copy_(param.half().float())  # exact in the GGUF's (1 + w) too
    model.save_pretrained(folder)
    transformers.PreTrainedTokenizerFast(tokenizer_object=build_tokenizer()).save_pretrained(folder)
    return folder


def write_tiny_gemma3_gguf(path: Path, hf_folder: Path) -> Path:
    """The same weights as llama.cpp's converter writes them: norms stored as 1 + w, no q/k permutation;
    the keys its converter leaves out (the local RoPE base, the layer pattern) as llama.cpp reads them."""
    cfg = json.loads((hf_folder / "config.json").read_text())
    writer = GGUFWriter(path, "gemma3")
    add_shape_keys(writer, cfg)
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_parameters"][FULL]["rope_theta"])
    writer.add_float32("gemma3.rope.freq_base_swa", cfg["rope_parameters"][SLIDING]["rope_theta"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_array("gemma3.attention.sliding_window_pattern", [t == SLIDING for t in cfg["layer_types"]])
    writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_vocab_size(cfg["vocab_size"])
    gguf_names = {hf: gguf for gguf, hf in GEMMA3_GGUF_LAYER_NAMES.items()}
    for name, tensor in load_file(hf_folder / "model.safetensors").items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{gguf_names[part]}.{kind}"
        array = (tensor + 1 if name.endswith("norm.weight") else tensor).float().numpy()
        writer.add_tensor(gguf_name, array, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"))


@pytest.fixture(scope="module")
def gguf_path(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("tiny_gemma3_gguf") / "tiny.gguf", hf_dir)


def test_config_from_transformers_5_config_json(hf_dir: Path) -> None:
    config = load_model_config(ModelSource(hf_dir, "hf", "tiny"))
    assert isinstance(config, Gemma3Config)
    assert config.architecture == "Gemma3ForCausalLM"
    assert (config.head_dim, config.query_pre_attn_scalar) == (32, 20)
    assert (config.rope_theta, config.rope_local_base_freq, config.rope_scaling) == (50_000.0, 300.0, None)
    assert config.final_logit_softcapping == 3.0 and config.tie_word_embeddings
    assert config.layer_types == tuple(LAYER_TYPES)
    assert [config.layer_window(i) for i in range(3)] == [WINDOW, None, WINDOW]


def test_config_from_an_older_config_json() -> None:
    """Before transformers 5: rope_theta, rope_local_base_freq and rope_scaling at the top level, and
    the pattern as an int (every sixth layer global); Gemma's defaults where the file is silent."""
    raw: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256,
    }
    config = Gemma3Config.from_hf_dict(raw)
    assert config.layer_types == (SLIDING,) * 5 + (FULL,) + (SLIDING,) * 2
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert (config.rope_theta, config.rope_local_base_freq) == (1_000_000.0, 10_000.0)
    assert (config.vocab_size, config.head_dim, config.tie_word_embeddings) == (262_208, 256, True)
    assert config.final_logit_softcapping is None


@pytest.mark.parametrize(
    "change, field",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"layer_types": [SLIDING, "chunked_attention", SLIDING]}, "layer_types"),
    ],
)
def test_config_refuses_what_the_model_does_not_compute(
    hf_dir: Path, change: dict[str, Any], field: str
) -> None:
    raw = {**json.loads((hf_dir / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=field):
        Gemma3Config.from_hf_dict(raw)


def test_gguf_config_equals_the_hf_config(hf_dir: Path, gguf_path: Path) -> None:
    # a Gemma 3 checkpoint: its config is a Gemma3Config
    from_hf = cast(Gemma3Config, load_model_config(ModelSource(hf_dir, "hf", "tiny")))
    from_gguf = cast(Gemma3Config, load_model_config(ModelSource(gguf_path, "gguf", "tiny")))
    # The GGUF states its context length, not HF's default, and the score scale as llama.cpp derives it.
    assert from_gguf.query_pre_attn_scalar == 32
    assert from_gguf == Gemma3Config(**{**vars(from_hf), "query_pre_attn_scalar": 32.0})


def test_gguf_without_pattern_or_local_base_reads_llama_cpp_defaults(tmp_path: Path) -> None:
    """What llama.cpp's converter writes for Gemma 3: no pattern (every sixth layer is global) and no
    local RoPE base (10000); the 62-layer 27B scales scores by hidden / heads, not head_dim."""
    path = tmp_path / "header.gguf"
    writer = GGUFWriter(path, "gemma3")
    writer.add_block_count(62)
    writer.add_context_length(131072)
    writer.add_embedding_length(5376)
    writer.add_feed_forward_length(21504)
    writer.add_head_count(32)
    writer.add_head_count_kv(16)
    writer.add_key_length(128)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(1024)
    writer.add_vocab_size(262_144)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    config = Gemma3Config.from_gguf(read_gguf_header(path), "Gemma3ForCausalLM")
    assert config.layer_types is not None
    assert [i for i, t in enumerate(config.layer_types) if t == FULL] == list(range(5, 62, 6))
    assert (config.rope_local_base_freq, config.query_pre_attn_scalar) == (10_000.0, 5376 / 32)
    assert config.final_logit_softcapping is None and config.tie_word_embeddings


def test_gguf_weights_load_as_the_safetensors_ones(hf_dir: Path, gguf_path: Path) -> None:
    """Norms come back as w from llama.cpp's 1 + w; every other tensor as it is."""
    models = []
    for source in (ModelSource(hf_dir, "hf", "tiny"), ModelSource(gguf_path, "gguf", "tiny")):
        model = Gemma3ForCausalLM(cast(Gemma3Config, load_model_config(source)))  # a Gemma 3 checkpoint
        model.load_weights(iter_weights(source))
        models.append(model.state_dict())
    hf, gguf = models
    assert hf.keys() == gguf.keys()
    for name in hf:
        torch.testing.assert_close(gguf[name], hf[name], rtol=0, atol=1e-7, msg=name)
    assert hf["layers.0.input_layernorm.weight"].abs().max() < 0.6  # w, not 1 + w


def prompts() -> list[list[int]]:
    rng = random.Random("gemma3")
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=[True, False], ids=["c_kernels", "pytorch"])
def llm(request: pytest.FixtureRequest, hf_dir: Path) -> Iterator[LLM]:
    engine = LLM(
        model=str(hf_dir),
        dtype="float32",
        kv_cache_memory=8 << 20,
        multiprocess=False,
        max_num_batched_tokens=16,  # the long prompt in chunks, beside the short one's decodes
        native_kernels=request.param,
    )
    yield engine
    engine.shutdown()


def test_greedy_output_equals_transformers(llm: LLM, hf_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    native_steps = count_native_steps(monkeypatch)
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    hf.generation_config.eos_token_id = None
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    for out in outputs:
        ref = hf_greedy(hf, out.prompt_token_ids, NUM_TOKENS)
        assert_matches_hf(llm, out, ref)
        assert_top_logprobs_match(out.outputs[0], ref, k=3, tolerance=1e-4)
    # with our kernels, Gemma's decode-only steps run every layer in one decoder_step.c call
    assert (native_steps[0] > 0) == core_of(llm).model_runner.plan.stored_weights, native_steps
