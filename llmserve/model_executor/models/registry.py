"""Which file under `models/` runs a checkpoint, by the name its config gives the architecture.

Hugging Face's `config.json` names it in `architectures`; a GGUF in `general.architecture`, in
llama.cpp's spelling, mapped here to Hugging Face's. Adding an architecture is one entry here and one
file under `models/`. Modules are imported when asked for, so a broken one cannot stop the others.
"""

from __future__ import annotations

import importlib

from llmserve.model_executor.models.causal_lm import CausalLM

# Hugging Face architecture → (module under models/, class in it)
_MODELS = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
}
# llama.cpp's `general.architecture` → Hugging Face architecture
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# llama.cpp's converter interleaves the rows of q_proj and k_proj for these (see weights._unpermute_rows)
GGUF_PERMUTED_QK = frozenset({"llama", "mistral"})


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type[CausalLM]:
    """The class that runs `architecture`; `ValueError` naming it and the supported ones otherwise."""
    if architecture not in _MODELS:
        raise ValueError(
            f"Unsupported architecture {architecture!r}; "
            f"llmserve runs {', '.join(supported_architectures())}."
        )
    module, name = _MODELS[architecture]
    cls = getattr(importlib.import_module(f"llmserve.model_executor.models.{module}"), name)
    assert issubclass(cls, CausalLM)
    return cls


def architecture_from_gguf(gguf_architecture: str, path: object) -> str:
    """Hugging Face's name for a GGUF's `general.architecture`."""
    if gguf_architecture not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"Unsupported architecture {gguf_architecture!r} in {path}; llmserve reads GGUF files of "
            f"{', '.join(sorted(_GGUF_ARCHITECTURES))}."
        )
    return _GGUF_ARCHITECTURES[gguf_architecture]
