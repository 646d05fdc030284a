"""BERT (`BertModel`): a bidirectional encoder, for embeddings.

word + position + token-type embeddings → LayerNorm → N × (QKV → attention over the whole prompt →
output projection → residual → LayerNorm → up → GELU → down → residual → LayerNorm). Post-norm, unlike
the decoders; no KV cache: every prompt is computed whole, in one step. Q, K and V share one
projection. The batch is packed (no padding), so each token carries its own position, from 0 at the
start of its prompt. The output is every token's last hidden state; the pooler makes the vector.

Projections are dense weights through the plan's kernel (oneDNN's pre-packed product on the CPU in
fp32, with the GELU and the residual adds in the products' own calls): an encoder multiplies whole
prompts, products of hundreds of rows, where that kernel leads; the stored-weight kernels are built
for decoding.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from llmserve.model_executor.execution_plan import ExecutionPlan
from llmserve.model_executor.layers.encoder_attention import encoder_attention
from llmserve.model_executor.layers.linear import Linear
from llmserve.model_executor.layers.stored_weight import StoredTensor

if TYPE_CHECKING:  # the loader package imports the models, so this one cannot import it at run time
    from llmserve.model_executor.loader.gguf_file import GGUFHeader

# Hugging Face's names inside `encoder.layer.{i}.` → ours inside `layers.{i}.`, with the shard of a fused
# projection (Q, K and V are one).
_LAYER_NAMES: dict[str, tuple[str, int | None]] = {
    "attention.self.query": ("qkv_proj", 0),
    "attention.self.key": ("qkv_proj", 1),
    "attention.self.value": ("qkv_proj", 2),
    "attention.output.dense": ("o_proj", None),
    "attention.output.LayerNorm": ("attn_norm", None),
    "intermediate.dense": ("up_proj", None),
    "output.dense": ("down_proj", None),
    "output.LayerNorm": ("mlp_norm", None),
}
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embed_norm",
}
# Checkpoint tensors an embedding does not use: the position ids buffer, BERT's CLS pooler (tanh dense,
# trained for next-sentence prediction; sentence-transformers pools the hidden states instead) and
# the masked-LM head.
_UNUSED_PREFIXES = ("embeddings.position_ids", "pooler.", "cls.")


@dataclass(frozen=True)
class BertConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def cache_window(self) -> int | None:
        """An encoder keeps no KV cache, so nothing slides out of one."""
        return None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> BertConfig:
        """From a Hugging Face config.json; BERT's variants we do not compute are refused."""
        position_type = cfg.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"BERT with position_embedding_type {position_type!r} is not supported.")
        if cfg.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"BERT with hidden_act {cfg['hidden_act']!r} is not supported (only gelu).")
        archs = cfg.get("architectures") or ["BertModel"]
        return cls(
            architecture=archs[0],
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 512)),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        )

    @classmethod
    def from_gguf(cls, header: GGUFHeader, architecture: str) -> BertConfig:
        raise ValueError(f"{header.path}: BERT is read from Hugging Face folders (safetensors), not GGUF.")


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv_proj = Linear(hidden, 3 * hidden, True, stored=False)
        self.o_proj = Linear(hidden, hidden, True, stored=False)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps)
        self.up_proj = Linear(hidden, config.intermediate_size, True, stored=False)
        self.down_proj = Linear(config.intermediate_size, hidden, True, stored=False)
        self.mlp_norm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        attended = encoder_attention(self.qkv_proj(x), seq_lens, self.num_heads, self.head_dim)
        x = self.attn_norm(self.o_proj.forward_add(attended, x))
        return self.mlp_norm(self.down_proj.forward_add(self.up_proj.forward_gelu(x), x))


class BertModel(nn.Module):
    config_class: ClassVar[type[BertConfig]] = BertConfig

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embed_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens], each from 0 within its prompt
        seq_lens: list[int],  # the packed prompts' lengths, in order
    ) -> torch.Tensor:
        """Every token's last hidden state [num_tokens, hidden_size]. Every token is of segment 0 (one
        sentence per prompt, as sentence-transformers encodes)."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embed_norm(x + self.token_type_embeddings.weight[0])
        for layer in self.layers:
            x = layer(x, seq_lens)
        return x

    def prepare_kernels(self, plan: ExecutionPlan) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare(plan)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | StoredTensor]]) -> None:
        """Take checkpoint tensors (Hugging Face names, with or without the `bert.` prefix of BERT's
        task models); every parameter must be set."""
        params = dict(self.named_parameters())
        expected: set[tuple[str, int | None]] = {(name, None) for name in params if ".qkv_proj." not in name}
        expected |= {(name, i) for name in params if ".qkv_proj." in name for i in range(3)}
        loaded: set[tuple[str, int | None]] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("bert.")
            if name.startswith(_UNUSED_PREFIXES):
                continue
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"Checkpoint tensor {hf_name!r}: BERT takes dense tensors only.")
            target, shard = _our_name(name)
            param = params.get(target)
            if param is None:
                raise ValueError(f"Checkpoint tensor {hf_name!r} has no place in BertModel.")
            dest = param.data
            if shard is not None:
                rows = self.config.hidden_size
                dest = dest.narrow(0, shard * rows, rows)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(
                    f"Checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(dest.shape)}."
                )
            dest.copy_(tensor)
            loaded.add((target, shard))
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}.")


def _our_name(name: str) -> tuple[str, int | None]:
    """A checkpoint name (without `bert.`) → our parameter's name and its shard of a fused projection."""
    module, _, kind = name.rpartition(".")
    if module in _EMBEDDING_NAMES:
        return f"{_EMBEDDING_NAMES[module]}.{kind}", None
    parts = module.split(".", 3)  # encoder, layer, i, the rest
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"] and parts[3] in _LAYER_NAMES:
        ours, shard = _LAYER_NAMES[parts[3]]
        return f"layers.{parts[2]}.{ours}.{kind}", shard
    return name, None
