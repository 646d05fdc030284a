"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Reads like the architecture: embed → N × (RMSNorm → attention → residual → RMSNorm → SwiGLU → residual)
→ RMSNorm → logits. Q, K and V share one projection, as do the MLP's gate and up.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config import Quantization
from llmserve.model_executor.attention import AttentionMetadata, paged_attention
from llmserve.model_executor.huge_pages import cat_huge
from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.layers.linear import BlockKernel, Linear, LinearKernel, make_kernel
from llmserve.model_executor.layers.rotary_embedding import RopeAngles, RotaryEmbedding, apply_rope
from llmserve.model_executor.models.llama_config import LlamaConfig
from llmserve.model_executor.models.native_decoder import NativeDecoder

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [kv_heads, num_blocks, block_size, head_dim]


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self, rope: RopeAngles, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(-1, self.num_heads, self.head_dim), rope)
        k = apply_rope(k.view(-1, self.num_kv_heads, self.head_dim), rope)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, rope: RopeAngles, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # Checkpoint name fragment → (our fused parameter fragment, shard index among its parts).
    FUSED_SHARDS = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # With tied embeddings the output projection is the embedding matrix itself.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.logits_kernel: LinearKernel | None = None
        self.native_decoder: NativeDecoder | None = None  # decode steps in C, after prepare_kernels

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] after the final norm."""
        x = self.embed_tokens(input_ids)
        if self.native_decoder is not None and self.native_decoder.accepts(meta):
            return self.native_decoder(x, positions, kv_caches, meta)
        rope = self.rotary(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(rope, x, kv_cache, meta)
        return self.norm(x)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_kernel is not None:
            return self.logits_kernel(hidden).float()
        return F.linear(hidden, self.lm_head_weight).float()

    def prepare_kernels(self, quantization: Quantization, native_kernels: bool) -> None:
        """Choose every projection's kernel, the output one included (see `layers/linear.py`)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepare(quantization, native_kernels)
        self.logits_kernel = make_kernel(self.lm_head_weight, None, quantization, native_kernels)
        self._choose_decoder()

    def attach_blocks(
        self, blocks: Iterable[tuple[str, int, torch.Tensor]], int8_activations: bool = False
    ) -> None:
        """Give each projection whose blocks are given (fused, or as checkpoint shards sharing one block
        type) a `BlockKernel` over them (see `layers/linear.py`); after `prepare_kernels`, whose kernels
        take the larger batches."""
        by_name = {name.removeprefix("model."): (qtype, rows) for name, qtype, rows in blocks}
        for name, module in self.named_modules():
            if not isinstance(module, Linear) or module.kernel is None:
                continue
            prefix, _, fragment = name.rpartition(".")
            shards = [fragment]
            if fragment in ("qkv_proj", "gate_up_proj") and f"{name}.weight" not in by_name:
                shards = [part for part, (fused, _) in self.FUSED_SHARDS.items() if fused == fragment]
            found = [by_name.get(f"{prefix}.{shard}.weight") for shard in shards]
            if all(found) and len({qtype for qtype, _ in found}) == 1:  # type: ignore[misc]
                rows = cat_huge([r for _, r in found])  # type: ignore[misc]
                qtype = found[0][0]  # type: ignore[index]
                module.kernel = BlockKernel(
                    rows, qtype, module.out_features, module.bias, module.kernel, int8_activations
                )
        head = by_name.get("lm_head.weight" if self.lm_head is not None else "embed_tokens.weight")
        if head is not None and self.logits_kernel is not None:
            qtype, rows = head
            self.logits_kernel = BlockKernel(
                cat_huge([rows]), qtype, self.config.vocab_size, None, self.logits_kernel, int8_activations
            )
        self._choose_decoder()

    def _choose_decoder(self) -> None:
        """Decode steps run in C (`NativeDecoder`) when every projection's kernels allow."""
        self.native_decoder = NativeDecoder(self) if NativeDecoder.applies_to(self) else None

    def shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        return [c.intermediate_size, c.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into our parameters; every one must be set."""
        params = dict(self.named_parameters())
        expected: set[tuple[str, int | None]] = {(name, None) for name in params}
        for name in params:
            fragment = name.split(".")[-2] if "." in name else ""
            if fragment in ("qkv_proj", "gate_up_proj"):
                expected.discard((name, None))
                expected.update((name, i) for i in range(len(self.shard_sizes(fragment))))
        loaded: set[tuple[str, int | None]] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, fused, shard = name, "", None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self.FUSED_SHARDS:
                fused, shard = self.FUSED_SHARDS[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            param = params.get(target)
            if param is None:
                raise ValueError(f"Checkpoint tensor {hf_name!r} has no place in {type(self).__name__}.")
            dest = param.data
            if shard is not None:
                sizes = self.shard_sizes(fused)
                dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"Checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dest.shape)}."
                )
            dest.copy_(tensor)
            loaded.add((target, shard))
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}.")
