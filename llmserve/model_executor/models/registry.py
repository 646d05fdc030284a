"""Which file under `models/` runs a checkpoint, by the name its config gives the architecture.

Hugging Face's `config.json` names it in `architectures`; a GGUF in `general.architecture`, in
llama.cpp's spelling, mapped here to Hugging Face's. Adding an architecture is one entry here and one
file under `models/`. Modules are imported when asked for, so a broken one cannot stop the others.
Encoders (BERT) are models of their own kind: no KV cache, no logits; they serve embeddings.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from llmserve.config import ResolvedRunner, Runner
from llmserve.model_executor.models.causal_lm import CausalLM
from llmserve.model_executor.models.decoder_config import DecoderConfig

if TYPE_CHECKING:
    from llmserve.model_executor.loader.gguf_file import GGUFHeader
    from llmserve.model_executor.models.bert import BertConfig, BertModel

# Hugging Face architecture → (module under models/, class in it)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "OlmoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
}
# Hugging Face architecture → what is missing, for models we refuse with a reason rather than a list
_NOT_YET = {
    "GptOssForCausalLM": (
        "gpt-oss needs MXFP4 experts, attention sinks and the harmony chat format, not built yet"
    ),
}
# Hugging Face architecture → (module under models/, class in it), for the bidirectional encoders
_ENCODERS = {
    "BertModel": ("bert", "BertModel"),
}
# llama.cpp's `general.architecture` → Hugging Face architecture
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# llama.cpp's converter interleaves the rows of q_proj and k_proj for these (see weights._unpermute_rows)
GGUF_PERMUTED_QK = frozenset({"llama", "mistral"})


def supported_architectures() -> list[str]:
    return sorted([*_MODELS, *_ENCODERS])


def is_encoder(architecture: str) -> bool:
    return architecture in _ENCODERS


def model_class(architecture: str) -> type[CausalLM]:
    """The decoder that runs `architecture`; `ValueError` naming it and the supported ones otherwise."""
    cls = _import(architecture, _MODELS)
    assert issubclass(cls, CausalLM)
    return cls


def encoder_class(architecture: str) -> type[BertModel]:
    """The encoder that runs `architecture`; `ValueError` naming it and the supported ones otherwise."""
    cls: type[BertModel] = _import(architecture, _ENCODERS)
    return cls


def config_class(architecture: str) -> type[DecoderConfig] | type[BertConfig]:
    """The class that reads `architecture`'s hyper-parameters from its checkpoint."""
    if is_encoder(architecture):
        return encoder_class(architecture).config_class
    return model_class(architecture).config_class


def _import(architecture: str, known: dict[str, tuple[str, str]]) -> type:
    if architecture in _NOT_YET:
        raise ValueError(f"Unsupported architecture {architecture!r}: {_NOT_YET[architecture]}.")
    if architecture not in known:
        raise ValueError(
            f"Unsupported architecture {architecture!r}; "
            f"llmserve runs {', '.join(supported_architectures())}."
        )
    module, name = known[architecture]
    cls: type = getattr(importlib.import_module(f"llmserve.model_executor.models.{module}"), name)
    return cls


def architecture_from_gguf(header: GGUFHeader) -> str:
    """Hugging Face's name for a GGUF's `general.architecture` (a `llama` one with experts is Mixtral)."""
    gguf_architecture = header.architecture
    if gguf_architecture not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"Unsupported architecture {gguf_architecture!r} in {header.path}; llmserve reads GGUF files of "
            f"{', '.join(sorted(_GGUF_ARCHITECTURES))}."
        )
    if gguf_architecture == "llama" and header.metadata.get("llama.expert_count"):
        return "MixtralForCausalLM"
    return _GGUF_ARCHITECTURES[gguf_architecture]


def resolve_runner(requested: Runner, architecture: str) -> ResolvedRunner:
    """vLLM's `--runner auto`: pooling for an encoder, generate for a decoder. An encoder cannot
    generate; a decoder may pool (embeddings from its last token)."""
    if requested == "auto":
        return "pooling" if is_encoder(architecture) else "generate"
    if requested == "generate" and is_encoder(architecture):
        raise ValueError(f"runner generate: {architecture} is an encoder, which only embeds (runner pooling)")
    return requested
