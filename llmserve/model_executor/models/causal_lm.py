"""What every decoder-only architecture shares: embedding, the layers' loop, final norm and logits,
loading checkpoint tensors by their Hugging Face names, and taking its kernels from the execution plan.

An architecture's file subclasses `CausalLM`, builds `self.layers` (`layers/decoder_layer.py`'s
`DecoderLayer`s) and `self.norm`, and names what differs: its config class, the checkpoint shards it
fuses, how GGUF names its tensors, how it scales embeddings or caps logits. With `stored=True` the
projections and the embedding hold the checkpoint's weights as stored (`layers/stored_weight.py`), and
tied embeddings are one tensor for input and output.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.model_executor.attention import AttentionMetadata
from llmserve.model_executor.execution_plan import ExecutionPlan
from llmserve.model_executor.layers.decoder_layer import DecoderLayer, KVCache
from llmserve.model_executor.layers.embedding import StoredEmbedding
from llmserve.model_executor.layers.linear import Linear, LinearKernel, StoredKernel, dense_kernel
from llmserve.model_executor.layers.moe import SparseMoE
from llmserve.model_executor.layers.rotary_embedding import RopeAngles, RotaryEmbedding
from llmserve.model_executor.layers.stored_weight import StoredTensor, StoredWeight
from llmserve.model_executor.models.decoder_config import DecoderConfig
from llmserve.model_executor.quantization import requantize

__all__ = ["KVCache", "CausalLM"]

# llama.cpp's tensor names inside a layer → Hugging Face's, for the Llama layout; an architecture with
# other tensors passes its own.
LLAMA_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class CausalLM(nn.Module):
    config_class: ClassVar[type[DecoderConfig]] = DecoderConfig
    # Checkpoint name fragment → (our fused parameter fragment, shard index among its parts).
    fused_shards: ClassVar[dict[str, tuple[str, int]]] = {}
    # Checkpoint name fragment → ours, where a family names a module otherwise (Mixtral's experts' w1).
    checkpoint_renames: ClassVar[dict[str, str]] = {}
    gguf_layer_names: ClassVar[dict[str, str]] = LLAMA_GGUF_LAYER_NAMES

    layers: nn.ModuleList  # of DecoderLayer
    norm: nn.Module

    def __init__(self, config: DecoderConfig, stored: bool) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | StoredEmbedding = (
            StoredEmbedding(config.vocab_size, config.hidden_size)
            if stored
            else nn.Embedding(config.vocab_size, config.hidden_size)
        )
        # With tied embeddings the output projection is the embedding matrix itself.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, stored)
        )
        self.logits_kernel: LinearKernel | None = None
        # A stored head's products write a step's sampled logits here, not into a new tensor: at 64 rows
        # of a 262,144-token vocabulary a new one is 67 MB of fresh pages, faulted in at every step.
        self.logits_buffer = torch.empty(0)

    @classmethod
    def gguf_tensor(cls, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A dense GGUF tensor in the form the Hugging Face checkpoint holds it (llama.cpp's converters
        change some, e.g. Gemma's norms)."""
        return tensor

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        """The cos/sin tables, rebuilt after the model leaves the meta device."""
        return [m for m in self.modules() if isinstance(m, RotaryEmbedding)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] after the final norm."""
        x = self.embed(input_ids)
        angles: dict[int, RopeAngles] = {}  # each table's rows for these positions, looked up once
        for layer, kv_cache in zip(self.decoder_layers(), kv_caches):
            rotary = layer.parts.rotary
            if id(rotary) not in angles:
                angles[id(rotary)] = rotary(positions)
            x = layer(angles[id(rotary)], x, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor:
        """Logits [rows, vocab] fp32 of hidden [rows, hidden_size]. With `reuse` (a step's sampling) a
        stored head writes them into `logits_buffer`, valid until the next such call; the prompt
        logprobs' chunks of up to a thousand rows take new tensors, so the buffer stays as large as
        the most rows a step has sampled."""
        if reuse and isinstance(self.logits_kernel, StoredKernel):
            rows = hidden.shape[0]
            if self.logits_buffer.shape[0] < rows:
                self.logits_buffer = torch.empty(rows, self.config.vocab_size)
            return self.logits_kernel(hidden, out=self.logits_buffer[:rows])
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

    def prepare_kernels(self, plan: ExecutionPlan) -> None:
        """Every projection's kernel from the plan, the output one included, and the layers' own; stored
        weights are first rounded as the plan's quantization asks (see `quantization.py`)."""
        for name, linear in self.named_modules():
            if not isinstance(linear, Linear):
                continue
            if linear.stored and plan.quantization != "none":
                parts = [p for p in linear.parts if p is not None]
                linear.parts = list(requantize(parts, plan.quantization, name))
            linear.prepare(plan)
        for layer in self.decoder_layers():
            layer.prepare(plan)
        if self.lm_head is not None:
            self.logits_kernel = self.lm_head.kernel
        elif isinstance(self.embed_tokens, StoredEmbedding):
            head = self.embed_tokens.table
            assert head is not None, "load the weights first"
            if plan.quantization != "none":  # as a GGUF's quantized tied embedding would be
                head = self.embed_tokens.table = requantize([head], plan.quantization, "embed_tokens")[0]
            self.logits_kernel = StoredKernel(StoredWeight([head], None), plan)
        else:
            self.logits_kernel = dense_kernel(self.embed_tokens.weight, None, plan)

    def shard_sizes(self, fused: str, target: str) -> list[int]:
        """The rows of each checkpoint shard of the fused projection `target` (our parameter's name)."""
        c = self.config
        if fused == "qkv_proj":
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        if fused == "gate_up_proj":  # a dense MLP's, an expert's or a shared expert's: halves
            module = self.get_submodule(target.removesuffix(".weight"))
            assert isinstance(module, Linear)
            return [module.out_features // 2] * 2
        raise ValueError(f"{type(self).__name__} has no fused projection {fused!r}.")

    def parameter_counts(self) -> tuple[int, int]:
        """(every weight, the weights one token reads): they differ by the experts a token skips."""
        total = sum(p.numel() for p in self.parameters())
        total += sum(linear.out_features * linear.in_features for linear in self.linears() if linear.stored)
        if isinstance(self.embed_tokens, StoredEmbedding):
            total += self.embed_tokens.num_embeddings * self.embed_tokens.embedding_dim
        skipped = sum(m.inactive_parameters() for m in self.modules() if isinstance(m, SparseMoE))
        return total, total - skipped

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | StoredTensor]]) -> None:
        """Take checkpoint tensors (Hugging Face names): dense ones are copied into our parameters, stored
        ones kept as they are (`stored=True`); every one must be set."""
        params = dict(self.named_parameters())
        fused_targets = {fused for fused, _ in self.fused_shards.values()}
        expected: set[tuple[str, int | None]] = {(name, None) for name in params}
        for name in params:
            fragment = name.split(".")[-2] if "." in name else ""
            if fragment in fused_targets:
                expected.discard((name, None))
                expected.update((name, i) for i in range(len(self.shard_sizes(fragment, name))))
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
            parts = [self.checkpoint_renames.get(part, part) for part in name.split(".")]
            if len(parts) >= 2 and parts[-2] in self.fused_shards:
                fused, shard = self.fused_shards[parts[-2]]
                parts[-2] = fused
            target = ".".join(parts)
            if isinstance(tensor, StoredTensor) and target in params:  # a dense parameter: a router, say
                tensor = tensor.dequantize()
            rows = self.shard_sizes(fused, target)[shard] if shard is not None else None
            if isinstance(tensor, StoredTensor):
                self._keep_stored(hf_name, target, shard, rows, tensor)
            else:
                self._copy_dense(hf_name, target, params.get(target), shard, fused, tensor)
            loaded.add((target, shard))
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise ValueError(f"The checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}.")

    def _copy_dense(
        self,
        hf_name: str,
        target: str,
        param: nn.Parameter | None,
        shard: int | None,
        fused: str,
        tensor: torch.Tensor,
    ) -> None:
        if param is None:
            raise ValueError(f"Checkpoint tensor {hf_name!r} has no place in {type(self).__name__}.")
        dest = param.data
        if shard is not None:
            sizes = self.shard_sizes(fused, target)
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
