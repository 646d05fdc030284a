"""The hyper-parameters of a decoder-only transformer, however the checkpoint spelled them.

The fields every architecture in `models/` reads; one with more (Gemma 3) subclasses this in its own
file. Which architectures exist is the registry's business (`models/registry.py`), not this file's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the loader package imports the models, so this one cannot import it at run time
    from llmserve.model_executor.loader.gguf_file import GGUFHeader


@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    # Layers that attend only to the last `sliding_window` tokens (their own included): every layer when
    # `layer_types` is None, else those whose type is "sliding_attention" (HF's spelling).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}.")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types names {len(self.layer_types)} layers; the model has {self.num_hidden_layers}."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )

    def layer_window(self, layer: int) -> int | None:
        """The window of layer `layer`, or None where it attends to the whole sequence."""
        if self.sliding_window is None:
            return None
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @property
    def cache_window(self) -> int | None:
        """The window every layer shares, so that blocks behind it can leave the cache; None when some
        layer keeps the whole sequence."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> DecoderConfig:
        """From a Hugging Face config.json."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else f"{str(cfg.get('model_type', '?')).capitalize()}ForCausalLM"
        num_heads = int(cfg["num_attention_heads"])
        # transformers >= 5 writes `rope_parameters` where older configs have rope_theta/rope_scaling.
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        hidden = int(cfg["hidden_size"])
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            rope_scaling=scaling,
            sliding_window=_sliding_window(cfg, arch),
            layer_types=_layer_types(cfg, arch),
        )

    @classmethod
    def from_gguf(cls, header: GGUFHeader, architecture: str) -> DecoderConfig:
        """From a GGUF's metadata (llama.cpp's keys, under its architecture's prefix)."""
        return cls(**gguf_fields(header, architecture))


def gguf_fields(header: GGUFHeader, architecture: str) -> dict[str, Any]:
    """The fields every architecture reads from a GGUF, for `from_gguf` (and its overrides)."""
    arch = header.architecture
    if "rope_freqs.weight" in header.tensors:
        raise ValueError(f"{header.path} uses per-frequency rope factors (rope_freqs), not supported yet.")
    meta = header.metadata

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{header.path} lacks the metadata key {arch}.{key!r}.")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    vocab_size = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    if not vocab_size:
        raise ValueError(f"{header.path} states no vocabulary size and has no tokenizer.ggml.tokens.")
    window = meta.get(f"{arch}.attention.sliding_window")
    return dict(
        architecture=architecture,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(head_dim or hidden // num_heads),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias="blk.0.attn_q.bias" in header.tensors,
        rope_scaling=_gguf_rope_scaling(meta, arch),
        sliding_window=int(window) if window else None,
    )


def _gguf_rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """llama.cpp's rope scaling keys, spelled as HF's `rope_scaling` dict."""
    rope_type = meta.get(f"{arch}.rope.scaling.type")
    if rope_type in (None, "none"):
        return None
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    scaling: dict[str, Any] = {"rope_type": rope_type, "factor": factor}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    """Qwen2/Qwen3 configs carry a window they do not use unless `use_sliding_window` is set (false by
    default, as in transformers); Mistral's is used wherever it is set."""
    window = cfg.get("sliding_window")
    if window is None or not cfg.get("use_sliding_window", not arch.startswith("Qwen")):
        return None
    return int(window)


def _layer_types(cfg: dict[str, Any], arch: str) -> tuple[str, ...] | None:
    """The config's `layer_types`, else Qwen's rule for configs older than that key: with a window, the
    layers from `max_window_layers` on slide and those before it see everything."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    if not arch.startswith("Qwen") or _sliding_window(cfg, arch) is None or "max_window_layers" not in cfg:
        return None
    first = int(cfg["max_window_layers"])
    layers = range(int(cfg["num_hidden_layers"]))
    return tuple("sliding_attention" if i >= first else "full_attention" for i in layers)
