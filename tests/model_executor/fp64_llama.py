"""Hugging Face's Llama/Qwen2 decoder written out in fp64, from gguf's reading of the stored weights: the
independent reference of our decoder's tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.model_executor.layers.decoder_layer import KVCache
from llmserve.model_executor.layers.stored_weight import StoredTensor
from llmserve.model_executor.models.decoder_config import DecoderConfig
from tests.model_executor.stored_weights import Q, reference

Weights = list[tuple[str, torch.Tensor | StoredTensor]]


def fp64_values(tensor: torch.Tensor | StoredTensor) -> torch.Tensor:
    """A weight's values as gguf reads its stored bytes (not our dequantization), in fp64."""
    if isinstance(tensor, torch.Tensor):
        return tensor.double()
    values = reference(tensor.data.numpy(), Q(tensor.qtype))
    return torch.from_numpy(values).reshape(tensor.rows, tensor.in_features).double()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, heads, d] at the last n of the keys' positions ([kv_len, kv_heads, d]), causal, GQA."""
    n, heads, _ = q.shape
    kv_len, kv_heads, _ = keys.shape
    k = keys.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [heads, kv_len, d]
    v = values.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, n, kv_len]
    future = torch.arange(kv_len)[None, :] > torch.arange(kv_len - n, kv_len)[:, None]
    return (scores.masked_fill(future, float("-inf")).softmax(-1) @ v).transpose(0, 1).reshape(n, -1)


class Fp64Llama:
    """Hugging Face's Llama/Qwen2 decoder (modeling_llama) written out in fp64: it shares nothing with the
    code under test but the weights' values. RoPE pairs dimension i of a head with i + head_dim/2
    (rotate-half), the order of Hugging Face checkpoints, in which the loader also puts GGUF's q/k rows."""

    def __init__(self, config: DecoderConfig, weights: Weights) -> None:
        self.c = config
        self.w = {name: fp64_values(tensor) for name, tensor in weights}
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
        self.inv_freq = config.rope_theta**-exponents

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.w.get(f"{name}.bias")
        return x @ self.w[f"{name}.weight"].T + (0 if bias is None else bias)

    def forward(
        self, ids: torch.Tensor, start: int, past: list[KVCache] | None = None
    ) -> tuple[torch.Tensor, list[KVCache]]:
        """Tokens `ids` [n] at positions start.., after `past` (per layer: the earlier positions' keys,
        rotated, and values [start, kv_heads, d]) → logits [n, vocab], and each layer's new (k, v)."""
        c, w, n = self.c, self.w, len(ids)
        angles = torch.outer(torch.arange(start, start + n, dtype=torch.float64), self.inv_freq)
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [n, 1, head_dim]
        x = w["model.embed_tokens.weight"][ids]
        new: list[KVCache] = []
        for i in range(c.num_hidden_layers):
            layer = f"model.layers.{i}."
            h = rms_norm(x, w[f"{layer}input_layernorm.weight"], c.rms_norm_eps)
            q, k, v = (self.linear(h, f"{layer}self_attn.{p}_proj").view(n, -1, c.head_dim) for p in "qkv")
            q = q * angles.cos() + rotate_half(q) * angles.sin()
            k = k * angles.cos() + rotate_half(k) * angles.sin()
            new.append((k, v))
            if past is not None:
                k, v = torch.cat([past[i][0].double(), k]), torch.cat([past[i][1].double(), v])
            x = x + self.linear(attend(q, k, v, c.head_dim**-0.5), f"{layer}self_attn.o_proj")
            h = rms_norm(x, w[f"{layer}post_attention_layernorm.weight"], c.rms_norm_eps)
            mlp = F.silu(self.linear(h, f"{layer}mlp.gate_proj")) * self.linear(h, f"{layer}mlp.up_proj")
            x = x + self.linear(mlp, f"{layer}mlp.down_proj")
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return rms_norm(x, w["model.norm.weight"], c.rms_norm_eps) @ head.T, new
