"""The structs and constants passed to the C kernels through ctypes, and the check that they match C's.

A ctypes Structure is a second declaration of a C struct, and a constant here a second definition of
kernels.h's: a field added, moved or retyped on one side only, or a value changed, would make the
kernels read the wrong bytes or take the wrong branch without any error. `layout_mismatches` compares
the sizes, offsets and values Python has with those layout.c reports from the compiler.
"""

from __future__ import annotations

import ctypes
import enum

from gguf import GGMLQuantizationType

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p

MAX_WEIGHT_PARTS = 3
BLOCK_GEMV_MAX_ROWS = 16  # block_q8.c's most rows
QK = 32  # weights per block of the legacy GGUF types, and of the int8 activations


class KernelStatus(enum.IntEnum):
    """What the functions native.py calls return (kernels.h's KERNEL_*)."""

    OK = 0
    UNSUPPORTED = -1  # a type, shape or CPU the kernel does not take
    NO_MEMORY = -2
    OUT_OF_BOUNDS = -3  # a length, position, slot or id outside the caches or rows


class MLPKind(enum.IntEnum):
    """A layer's MLP as decoder_step.c computes it (LayerSpec.mlp_kind)."""

    GATED = 0  # down(act(gate) * up): MLP_GATED
    EXPERTS = 1  # a router's top k of such MLPs per row: MLP_EXPERTS


# The MLP gate's activation (LayerSpec.activation, gated_activation.c's argument): ACTIVATION_*.
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# The GGML types the kernels read, by kernels.h's names, which are gguf's.
GGML_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16")
# Python's value of each constant of kernels.h it mirrors.
CONSTANTS = {
    "MLP_GATED": MLPKind.GATED,
    "MLP_EXPERTS": MLPKind.EXPERTS,
    "ACTIVATION_SILU": ACTIVATIONS["silu"],
    "ACTIVATION_GELU_TANH": ACTIVATIONS["gelu_tanh"],
    "BLOCK_GEMV_MAX_ROWS": BLOCK_GEMV_MAX_ROWS,
    "MAX_WEIGHT_PARTS": MAX_WEIGHT_PARTS,
    "QK": QK,
    **{f"KERNEL_{status.name}": status for status in KernelStatus},
    **{name: GGMLQuantizationType[name] for name in GGML_TYPES},
}


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
        *((name, Weight) for name in ("qkv", "o")),
        ("mlp_kind", _I64),  # MLPKind
        *((name, Weight) for name in ("gate_up", "down")),
        ("intermediate", _I64),  # the MLP's, or each expert's, width
        ("activation", _I64),  # ACTIVATIONS
        ("experts", ctypes.POINTER(Weight)),  # MLP_EXPERTS: each expert's gate_up, then its down
        ("router", Weight),  # MLP_EXPERTS: [num_experts, hidden] fp32
        *((name, _I64) for name in ("num_experts", "top_k", "norm_topk")),
        ("qk_norm_whole", _I64),  # q_norm and k_norm span the whole projections, not each head
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
        *((name, _I64) for name in ("intermediate", "num_blocks", "block_size")),  # the widest MLP
        ("kv_bf16", _I64),  # the caches hold bf16 (--kv-cache-dtype bfloat16), else fp32
        ("int8_activations", _I64),
        ("block_rows", _I64),
        ("rope_positions", _I64),  # rows of every layer's RoPE tables
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("norm_offset", ctypes.c_float),
        ("layers", ctypes.POINTER(LayerSpec)),
        ("final_norm", _PTR),  # NULL: not the last layers; the residual stream is the output
    ]


STRUCTS: tuple[type[ctypes.Structure], ...] = (WeightPart, Weight, LayerSpec, DecoderSpec)


def layout_mismatches(
    library: ctypes.CDLL,
    structs: tuple[type[ctypes.Structure], ...] = STRUCTS,
    constants: dict[str, int] = CONSTANTS,
) -> list[str]:
    """Each size or field offset of `structs`, and each value of `constants`, that differs from C's of the
    same name (-1: C has no such name); empty when they all agree."""
    layout = library.struct_layout
    layout.argtypes, layout.restype = [ctypes.c_char_p], _I64
    expected = {name: int(value) for name, value in constants.items()}
    for struct in structs:
        expected[struct.__name__] = ctypes.sizeof(struct)
        for field, *_ in struct._fields_:
            expected[f"{struct.__name__}.{field}"] = getattr(struct, field).offset
    found = []
    for name, python in expected.items():
        c = layout(name.encode())
        if c != python:
            found.append(f"{name}: Python {python}, C {c}")
    return found
