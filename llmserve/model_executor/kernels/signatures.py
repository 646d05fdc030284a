"""The C functions native.py calls, declared once in ctypes, and the check that the declarations match C's.

A ctypes declaration is a second prototype of a C function: a parameter added, dropped or retyped on one
side only would pass the wrong bytes, or read a return value that is not there, without any error.
signatures.c exports each function's kinds, computed from the types the compiler checks against its
prototype; `signature_mismatches` compares them with `SIGNATURES`, which `declare` applies.
"""

from __future__ import annotations

import ctypes
from typing import Any, TypeAlias

from llmserve.model_executor.kernels.structs import DecoderSpec, Weight

CType: TypeAlias = "type[ctypes._SimpleCData[Any]] | type[ctypes._Pointer[Any]]"

_I32, _I64, _F32, _PTR, _STR = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_char_p
_WEIGHT = ctypes.POINTER(Weight)
Signature: TypeAlias = "tuple[CType | None, list[CType]]"  # (restype, argtypes); None: void


def _function(restype: CType | None, *argtypes: CType) -> Signature:
    return restype, list(argtypes)


_PRODUCT = _function(_I32, _PTR, _I64, _I64, _WEIGHT, _I64, _PTR, _I32)  # block_gemv's and int8_gemm's

SIGNATURES: dict[str, Signature] = {
    "kernels_isa": _function(_STR),
    "struct_layout": _function(_I64, _STR),
    "kernel_signatures": _function(_I64, _STR, _I64),
    "row_bytes": _function(_I64, _I32, _I64),
    "is_block_type": _function(_I32, _I32),
    "round_rows": _function(None, _PTR, _I64, _I64, _PTR),
    "int8_gemm_available": _function(_I32),
    "dequantize_rows": _function(_I32, _PTR, _I32, _I64, _I64, _PTR, _I64, _PTR, _I32),
    "weight_gemm": _function(_I32, _PTR, _I64, _I64, _WEIGHT, _PTR, _I32),
    "block_gemv": _PRODUCT,
    "int8_gemm": _PRODUCT,
    "paged_decode_attention": _function(_I32, *[_PTR] * 6, *[_I64] * 9, _F32, _I32),
    "prefill_attention": _function(_I32, *[_PTR] * 4, *[_I64] * 3, _PTR, *[_I64] * 7, _F32, _I32),
    "decoder_step": _function(_I32, ctypes.POINTER(DecoderSpec), *[_PTR] * 5, _I64, _I64, _PTR, _I32),
    "argmax_rows": _function(None, _PTR, _I64, _I64, _PTR, _I32),
    "gated_activation": _function(None, _PTR, _I64, _I64, _I64, _PTR, _I32),
}

_KINDS: dict[Any, str] = {_I32: "i32", _I64: "i64", _F32: "f32", _PTR: "p", _STR: "char*", None: "void"}


def _kind(ctype: CType | None) -> str:
    """`ctype` as signatures.c spells a C type: a pointer to a struct is its name and a star."""
    if ctype in _KINDS:
        return _KINDS[ctype]
    if isinstance(ctype, type) and issubclass(ctype, ctypes._Pointer):
        return f"{ctype._type_.__name__}*"
    return f"{ctype!r}?"


def render(restype: CType | None, argtypes: list[CType]) -> str:
    """A declaration as signatures.c writes a prototype: "i32(p, i64)", "char*(void)"."""
    return f"{_kind(restype)}({', '.join(map(_kind, argtypes)) or 'void'})"


def c_signatures(library: ctypes.CDLL) -> dict[str, str]:
    """Each function's kinds as C's prototype gives them (kernel_signatures in signatures.c)."""
    function = library.kernel_signatures
    function.restype, function.argtypes = SIGNATURES["kernel_signatures"]
    size = 4096
    while True:
        buffer = ctypes.create_string_buffer(size)
        length = function(buffer, size)
        if length < size:
            break
        size = length + 1
    pairs = (line.partition(": ") for line in buffer.value.decode().splitlines())
    return {name: kinds for name, _, kinds in pairs}


def signature_mismatches(library: ctypes.CDLL, signatures: dict[str, Signature] = SIGNATURES) -> list[str]:
    """Each function whose declaration in `signatures` differs from C's, or that one side lacks; empty
    when they all agree."""
    c = c_signatures(library)
    found = []
    for name, (restype, argtypes) in signatures.items():
        python = render(restype, argtypes)
        if c.get(name) != python:
            found.append(f"{name}: Python {python}, C {c.get(name, 'none')}")
    found += [f"{name}: Python none, C {c[name]}" for name in c if name not in signatures]
    return found


def declare(library: ctypes.CDLL, signatures: dict[str, Signature] = SIGNATURES) -> None:
    """Sets each function's restype and argtypes as `signatures` declares them."""
    for name, (restype, argtypes) in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
