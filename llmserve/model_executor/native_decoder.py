"""Decode steps through `kernels/decoder_step.c`: the layers in one C call, built from the layers' parts.

Taken where the execution plan says so (stored weights: the CPU in fp32 with our kernels) and the step
holds decodes only; the model runner makes the choice. At a few rows the projections are ~half the step
and the ~1,500 PyTorch calls of the layers were the other half; at 64 rows those calls, with their
tensors larger than the caches, took ~15% of it. Steps with a prefill keep the PyTorch path. Both compute
the `DecoderLayer` of `layers/decoder_layer.py` from the same `LayerParts`: the spec below holds the
addresses of those very modules' weights, so an architecture is described once and either path runs it.
A layer whose MLP is of a kind the C lacks (`plan.op_by_op_layers`) runs its PyTorch forward between two
calls over the layers around it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from llmserve.model_executor.attention import AttentionMetadata
from llmserve.model_executor.execution_plan import ExecutionPlan
from llmserve.model_executor.kernels import native
from llmserve.model_executor.layers.decoder_layer import DecoderLayer, KVCache
from llmserve.model_executor.layers.layernorm import RMSNorm
from llmserve.model_executor.layers.linear import Linear, StoredKernel
from llmserve.model_executor.layers.mlp import GatedMLP
from llmserve.model_executor.layers.moe import SparseMoE
from llmserve.model_executor.layers.rotary_embedding import RopeAngles

if TYPE_CHECKING:
    from llmserve.model_executor.models.causal_lm import CausalLM


def _weight(linear: Linear) -> native.Weight:
    assert isinstance(linear.kernel, StoredKernel)
    return linear.kernel.weight.native


@dataclass
class _Run:
    """Consecutive layers that run the same way: through one decoder_step call (`spec`, over `specs`), or
    one by one through their PyTorch forward (`spec` None)."""

    layers: list[DecoderLayer]
    first: int  # the index of the first, into the model's layers and KV caches
    spec: native.DecoderSpec | None = None
    specs: ctypes.Array[native.LayerSpec] | None = None  # behind spec.layers
    experts: list[ctypes.Array[native.Weight]] = dataclasses.field(default_factory=list)  # behind specs


class NativeDecoder:
    def __init__(self, model: CausalLM, plan: ExecutionPlan) -> None:
        why = misfit(model)
        if why is not None:  # the runner asks misfit() first and plans op-by-op decodes instead
            raise ValueError(f"{why}: plan.without_fused_decode() before building a NativeDecoder.")
        layers = model.decoder_layers()
        self.model = model  # keeps the tensors behind the specs' addresses alive
        self.runs: list[_Run] = []
        runs = itertools.groupby(enumerate(layers), key=lambda item: item[0] not in plan.op_by_op_layers)
        for c_run, group in runs:
            members = list(group)
            first, run = members[0][0], [layer for _, layer in members]
            if c_run:
                last = first + len(run) == len(layers)
                self.runs.append(_Run(run, first, *_spec(model, run, plan, last)))
            else:
                self.runs.append(_Run(run, first))
        self.kv_caches: list[KVCache] | None = None

    @staticmethod
    def accepts(meta: AttentionMetadata) -> bool:
        return meta.native_decode and not meta.prefills and meta.num_decodes > 0

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """x: [rows, hidden] embedded tokens → hidden states after the final norm."""
        if kv_caches is not self.kv_caches:
            self._bind(kv_caches)
        angles: dict[int, RopeAngles] = {}  # for the layers run op by op
        for run in self.runs:
            if run.spec is not None:
                x = native.decoder_step(
                    run.spec, x, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens
                )
                continue
            for index, layer in enumerate(run.layers, run.first):
                rotary = layer.parts.rotary
                if id(rotary) not in angles:
                    angles[id(rotary)] = rotary(positions)
                x = layer(angles[id(rotary)], x, kv_caches[index], meta)
        return x if self.runs[-1].spec is not None else self.model.norm(x)

    def _bind(self, kv_caches: list[KVCache]) -> None:
        for run in self.runs:
            if run.spec is None or run.specs is None:
                continue
            pairs = kv_caches[run.first : run.first + len(run.layers)]
            for spec, layer, (k_cache, v_cache) in zip(run.specs, run.layers, pairs):
                spec.k_cache, spec.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
                # the tables are built with the cache, for its max_model_len (ModelRunner.initialize_kv_cache)
                rotary = layer.parts.rotary
                spec.rope_cos, spec.rope_sin = rotary.cos.data_ptr(), rotary.sin.data_ptr()
                run.spec.rope_positions = rotary.cos.shape[0]  # the same for every table
            _, run.spec.num_blocks, run.spec.block_size, _ = kv_caches[0][0].shape
            run.spec.kv_bf16 = kv_caches[0][0].dtype == torch.bfloat16  # else fp32 (`--kv-cache-dtype`)
        self.kv_caches = kv_caches


def _spec(
    model: CausalLM, layers: list[DecoderLayer], plan: ExecutionPlan, last: bool
) -> tuple[native.DecoderSpec, ctypes.Array[native.LayerSpec], list[ctypes.Array[native.Weight]]]:
    """decoder_step.c's view of `layers`, with the final norm where they are the model's last; and the
    arrays of the MoE layers' experts its specs point to."""
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
    shape = layers[0].shape
    specs = (native.LayerSpec * len(layers))()
    experts = [weights for spec, layer in zip(specs, layers) if (weights := _describe(spec, layer))]
    spec = native.DecoderSpec(
        num_layers=len(layers),
        hidden=model.config.hidden_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate=max(spec.intermediate for spec in specs),
        int8_activations=plan.int8_activations,
        block_rows=plan.block_rows,
        eps=norm.eps,
        scale=shape.scale,
        norm_offset=norm.offset,
        layers=ctypes.cast(specs, ctypes.POINTER(native.LayerSpec)),
        final_norm=_address(model.norm) if last else None,
    )
    return spec, specs, experts


def misfit(model: CausalLM) -> str | None:
    """Why decoder_step.c cannot run this model's layers (what it takes for granted), or None."""
    name, layers = type(model).__name__, model.decoder_layers()
    if len(op_by_op_layers(model)) == len(layers):
        return f"decoder_step.c computes none of {name}'s MLPs"
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if len({(norm.offset, norm.eps) for norm in norms}) != 1:
        return f"decoder_step.c takes one norm offset and eps per model; {name} has several"
    shapes = {dataclasses.replace(layer.shape, sliding_window=None) for layer in layers}
    if len(shapes) != 1:
        return f"decoder_step.c takes layers of one shape; {name} has {len(shapes)}"
    for layer in layers:
        p = layer.parts
        if (p.q_norm is None) != (p.k_norm is None):
            return f"decoder_step.c takes both q and k norms or neither; {name} has one"
        if p.rotary.rotary_dim != layer.shape.head_dim:
            return f"decoder_step.c rotates whole heads; {name} rotates part of each"
    return None


def op_by_op_layers(model: CausalLM) -> tuple[int, ...]:
    """The layers whose MLP is of a kind decoder_step.c has no code for: they decode through PyTorch."""
    return tuple(i for i, layer in enumerate(model.decoder_layers()) if layer.parts.mlp.kind is None)


def _describe(spec: native.LayerSpec, layer: DecoderLayer) -> ctypes.Array[native.Weight] | None:
    """Point `spec` at the layer's parts; an MoE layer's experts' weights are an array the spec points to,
    returned to be kept alive beside it."""
    p, mlp = layer.parts, layer.parts.mlp
    spec.input_norm, spec.post_norm = _address(p.input_norm), _address(p.mlp_norm)
    spec.q_norm, spec.k_norm = _address(p.q_norm), _address(p.k_norm)
    spec.qk_norm_whole = not p.qk_norm_per_head
    spec.attn_out_norm, spec.mlp_out_norm = _address(p.attn_out_norm), _address(p.mlp_out_norm)
    spec.qkv, spec.o = _weight(p.qkv), _weight(p.o)
    spec.sliding_window = layer.shape.sliding_window or 0
    spec.mlp_kind = mlp.kind
    if isinstance(mlp, GatedMLP):
        spec.intermediate, spec.activation = mlp.intermediate, native.ACTIVATIONS[mlp.activation]
        spec.gate_up, spec.down = _weight(mlp.gate_up_proj), _weight(mlp.down_proj)
        return None
    assert isinstance(mlp, SparseMoE) and mlp.kind is not None, f"decoder_step.c has no code for {mlp}"
    experts = [cast(GatedMLP, expert) for expert in mlp.experts]
    weights = (native.Weight * (2 * len(experts)))()
    for i, expert in enumerate(experts):
        weights[2 * i], weights[2 * i + 1] = _weight(expert.gate_up_proj), _weight(expert.down_proj)
    assert mlp.gate.stored is not None, "prepare the model's kernels first"
    spec.experts, spec.router = ctypes.cast(weights, ctypes.POINTER(native.Weight)), mlp.gate.stored.native
    spec.num_experts, spec.top_k, spec.norm_topk = len(experts), mlp.gate.top_k, mlp.gate.normalize
    spec.intermediate, spec.activation = experts[0].intermediate, native.ACTIVATIONS[experts[0].activation]
    return weights


def _address(norm: nn.Module | None) -> int | None:
    """An RMSNorm's weight, fp32 and contiguous as the C code reads it; None (NULL) for a missing norm."""
    if norm is None:
        return None
    assert isinstance(norm, RMSNorm) and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()
    return norm.weight.data_ptr()
