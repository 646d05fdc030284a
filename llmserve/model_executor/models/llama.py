"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Reads like the architecture: embed → N × (RMSNorm → attention → residual → RMSNorm → SwiGLU → residual)
→ RMSNorm → logits. Q, K and V share one projection, as do the MLP's gate and up.

With `stored=True` (the CPU with our kernels) the projections and the embedding hold the checkpoint's
weights as stored (`layers/stored_weight.py`), and tied embeddings are one tensor for input and output.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.config import Quantization
from llmserve.model_executor.attention import AttentionMetadata, paged_attention
from llmserve.model_executor.layers.embedding import StoredEmbedding
from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.layers.linear import Linear, LinearKernel, StoredKernel, dense_kernel
from llmserve.model_executor.layers.rotary_embedding import RopeAngles, RotaryEmbedding, apply_rope
from llmserve.model_executor.layers.stored_weight import StoredTensor, StoredWeight
from llmserve.model_executor.models.llama_config import LlamaConfig
from llmserve.model_executor.models.native_decoder import NativeDecoder
from llmserve.model_executor.quantization import requantize

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [kv_heads, num_blocks, block_size, head_dim]


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, stored: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        width = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(config.hidden_size, width, config.attention_bias, stored, shards=3)
        self.o_proj = Linear(self.q_size, config.hidden_size, False, stored)
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
    def __init__(self, config: LlamaConfig, stored: bool) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, stored, shards=2)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, stored: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, stored)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, stored)

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

    def __init__(self, config: LlamaConfig, stored: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | StoredEmbedding = (
            StoredEmbedding(config.vocab_size, config.hidden_size)
            if stored
            else nn.Embedding(config.vocab_size, config.hidden_size)
        )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, stored) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # With tied embeddings the output projection is the embedding matrix itself.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, stored)
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_kernel is not None:
            return self.logits_kernel(hidden).float()
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        assert isinstance(head, torch.Tensor)
        return F.linear(hidden, head).float()

    def weight_bytes(self) -> int:
        """Bytes of every weight as held: the stored ones (a tied embedding once) and the dense ones."""
        stored = [part for linear in self.linears() for part in linear.parts if part is not None]
        if isinstance(self.embed_tokens, StoredEmbedding) and self.embed_tokens.table is not None:
            stored.append(self.embed_tokens.table)
        unique = {part.data.data_ptr(): part.data.numel() for part in stored}
        return sum(unique.values()) + sum(p.numel() * p.element_size() for p in self.parameters())

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def prepare_kernels(self, quantization: Quantization = "none") -> None:
        """Choose every projection's kernel, the output one included (see `layers/linear.py`); with stored
        weights, round them first as `quantization` asks (see `quantization.py`)."""
        int8_activations = quantization in ("gguf", "int8", "int4")
        for name, linear in self.named_modules():
            if not isinstance(linear, Linear):
                continue
            if linear.stored and quantization != "none":
                parts = [p for p in linear.parts if p is not None]
                linear.parts = list(requantize(parts, quantization, name))
            linear.prepare(int8_activations)
        if self.lm_head is not None:
            self.logits_kernel = self.lm_head.kernel
        elif isinstance(self.embed_tokens, StoredEmbedding):
            head = self.embed_tokens.table
            assert head is not None, "load the weights first"
            if quantization != "none":  # as a GGUF's quantized tied embedding would be
                head = self.embed_tokens.table = requantize([head], quantization, "embed_tokens")[0]
            self.logits_kernel = StoredKernel(StoredWeight([head], None), int8_activations)
        else:
            self.logits_kernel = dense_kernel(self.embed_tokens.weight, None)
        self.native_decoder = NativeDecoder(self) if NativeDecoder.applies_to(self) else None

    def shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        return [c.intermediate_size, c.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | StoredTensor]]) -> None:
        """Take checkpoint tensors (Hugging Face names): dense ones are copied into our parameters, stored
        ones kept as they are (`stored=True`); every one must be set."""
        params = dict(self.named_parameters())
        expected: set[tuple[str, int | None]] = {(name, None) for name in params}
        for name in params:
            fragment = name.split(".")[-2] if "." in name else ""
            if fragment in ("qkv_proj", "gate_up_proj"):
                expected.discard((name, None))
                expected.update((name, i) for i in range(len(self.shard_sizes(fragment))))
        for name, module in self.named_modules():
            if isinstance(module, Linear) and module.stored:
                shards = range(len(module.parts)) if len(module.parts) > 1 else [None]
                expected.update((f"{name}.weight", i) for i in shards)
            elif isinstance(module, StoredEmbedding):
                expected.add((f"{name}.weight", None))
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
            rows = self.shard_sizes(fused)[shard] if shard is not None else None
            if isinstance(tensor, StoredTensor):
                self._keep_stored(hf_name, target, shard, rows, tensor)
            else:
                self._copy_dense(hf_name, params.get(target), shard, fused, tensor)
            loaded.add((target, shard))
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}.")

    def _copy_dense(
        self, hf_name: str, param: nn.Parameter | None, shard: int | None, fused: str, tensor: torch.Tensor
    ) -> None:
        if param is None:
            raise ValueError(f"Checkpoint tensor {hf_name!r} has no place in {type(self).__name__}.")
        dest = param.data
        if shard is not None:
            sizes = self.shard_sizes(fused)
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        _check_shape(hf_name, tuple(tensor.shape), tuple(dest.shape))
        dest.copy_(tensor)

    def _keep_stored(
        self, hf_name: str, target: str, shard: int | None, rows: int | None, tensor: StoredTensor
    ) -> None:
        try:
            module = (
                self.get_submodule(target.removesuffix(".weight")) if target.endswith(".weight") else None
            )
        except AttributeError:
            module = None
        if isinstance(module, StoredEmbedding):
            _check_shape(
                hf_name, (tensor.rows, tensor.in_features), (module.num_embeddings, module.embedding_dim)
            )
            module.table = tensor
        elif isinstance(module, Linear) and module.stored:
            shape = (rows if rows is not None else module.out_features, module.in_features)
            _check_shape(hf_name, (tensor.rows, tensor.in_features), shape)
            module.parts[shard or 0] = tensor
        else:
            raise ValueError(f"Checkpoint tensor {hf_name!r} has no place in {type(self).__name__}.")


def _check_shape(hf_name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if got != expected:
        raise ValueError(f"Checkpoint tensor {hf_name!r} has shape {got}, expected {expected}.")
