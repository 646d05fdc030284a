"""Which layers slide, read from a config.json as transformers reads it."""

from __future__ import annotations

from typing import Any

import pytest
import transformers

from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.models.registry import (
    encoder_class,
    is_encoder,
    model_class,
    supported_architectures,
)

CONFIGS = {
    "Qwen2ForCausalLM": transformers.Qwen2Config,
    "Qwen3ForCausalLM": transformers.Qwen3Config,
    "MistralForCausalLM": transformers.MistralConfig,
}
WINDOWED = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}


def hf_windows(config: transformers.PretrainedConfig) -> list[int | None]:
    """The window transformers gives each layer."""
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    return [config.sliding_window if t == "sliding_attention" else None for t in types]


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("options", [{}, WINDOWED], ids=["default", "windowed"])
@pytest.mark.parametrize("older", [False, True], ids=["layer_types", "before-layer_types"])
def test_each_layer_slides_as_in_transformers(arch: str, options: dict[str, Any], older: bool) -> None:
    config = CONFIGS[arch](
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, **options,
    )  # fmt: skip
    raw = {**config.to_dict(), "architectures": [arch]}
    if older:  # config.json files written before transformers had the key
        raw.pop("layer_types", None)
    ours = DecoderConfig.from_hf_dict(raw)
    assert [ours.layer_window(i) for i in range(4)] == hf_windows(config)


def test_every_registered_architecture_imports() -> None:
    for arch in supported_architectures():
        cls = encoder_class(arch) if is_encoder(arch) else model_class(arch)
        assert cls.__name__ in (arch, "LlamaForCausalLM")
