"""The structs passed to the C kernels through ctypes, and the check that they match the C layout.

A ctypes Structure is a second declaration of a C struct: a field added, moved or retyped on one side
only would make the kernels read the wrong bytes without any error. `layout_mismatches` compares the
sizes and offsets ctypes computes with those layout.c reports from the compiler.
"""

from __future__ import annotations

import ctypes

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p

MAX_WEIGHT_PARTS = 3


class WeightPart(ctypes.Structure):
    _fields_ = [("data", _PTR), ("qtype", _I64), ("rows", _I64)]


class Weight(ctypes.Structure):
    """weight_gemm.c's view of a stored weight: up to three parts of rows stacked, and a bias. The tensors
    behind the addresses must outlive it."""

    _fields_ = [("parts", WeightPart * MAX_WEIGHT_PARTS), ("num_parts", _I64), ("bias", _PTR)]


class LayerSpec(ctypes.Structure):
    _fields_ = [
        *((name, _PTR) for name in ("input_norm", "post_norm", "q_norm", "k_norm")),
        *((name, _PTR) for name in ("attn_out_norm", "mlp_out_norm")),  # the optional ones may be NULL
        *((name, Weight) for name in ("qkv", "o", "gate_up", "down")),
        ("k_cache", _PTR),
        ("v_cache", _PTR),
        ("sliding_window", _I64),  # keys a query sees, its own included; 0: the whole sequence
        ("rope_cos", _PTR),
        ("rope_sin", _PTR),
    ]


class DecoderSpec(ctypes.Structure):
    """decoder_step.c's view of a model: its shapes and the addresses of its weights and KV cache. The
    tensors behind the addresses must outlive it."""

    _fields_ = [
        *((name, _I64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim")),
        *((name, _I64) for name in ("intermediate", "num_blocks", "block_size")),
        ("kv_bf16", _I64),  # the caches hold bf16 (--kv-cache-dtype bfloat16), else fp32
        ("int8_activations", _I64),
        ("block_rows", _I64),
        ("activation", _I64),  # 0 SiLU, 1 tanh GELU
        ("rope_positions", _I64),  # rows of every layer's RoPE tables
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("norm_offset", ctypes.c_float),
        ("layers", ctypes.POINTER(LayerSpec)),
        ("final_norm", _PTR),
    ]


STRUCTS: tuple[type[ctypes.Structure], ...] = (WeightPart, Weight, LayerSpec, DecoderSpec)


def layout_mismatches(
    library: ctypes.CDLL, structs: tuple[type[ctypes.Structure], ...] = STRUCTS
) -> list[str]:
    """Each size or field offset of `structs` that differs from the C struct of the same name (-1: C has
    no such struct or field); empty when they all agree."""
    layout = library.struct_layout
    layout.argtypes, layout.restype = [ctypes.c_char_p], _I64
    found = []
    for struct in structs:
        expected = {struct.__name__: ctypes.sizeof(struct)}
        for field, *_ in struct._fields_:
            expected[f"{struct.__name__}.{field}"] = getattr(struct, field).offset
        for name, python in expected.items():
            c = layout(name.encode())
            if c != python:
                found.append(f"{name}: ctypes {python}, C {c}")
    return found
