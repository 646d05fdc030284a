"""A GGUF with a real model's shapes and Q4_K_M block types, and random weights: for speed, not quality.

Dense decoders (llama, qwen2) and Mixture-of-Experts ones (olmoe, qwen3moe: a router and the experts
stacked as 3-D tensors [experts, rows, cols], written expert by expert so only one is ever in memory).

gguf-py cannot quantize to K-quants, so blocks are written as raw bytes: random bytes, then finite
fp16 block scales over them. Q4_K is 144 bytes per 256 weights (fp16 d, fp16 dmin, 12 bytes of 6-bit
scales and mins, 128 bytes of 4-bit quants); Q6_K is 210 (128 bytes low 4 bits, 64 bytes high 2 bits,
16 int8 scales, fp16 d). The tokenizer is a made-up byte-level BPE of the model's vocabulary size, with
the model family's special tokens and chat template, that both llama.cpp and llmserve load.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.gguf_writer import WriterState

F32, Q4_K, Q6_K = GGMLQuantizationType.F32, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K

# Std of a dequantized weight in units of its block's d, for uniformly random block bytes:
# Q4_K w = d*sc*q - dmin*m (sc, m 6-bit, q 4-bit; dmin = 7.5 d centres it), Q6_K w = d*sc*(q-32)
# (sc int8, q 6-bit). Dividing a target std by these gives the d that produces it.
_STD_PER_D = {Q4_K: 258.3, Q6_K: 1365.7}
# (byte offset of an fp16 scale in the block, its multiple of d)
_SCALE_FIELDS = {Q4_K: ((0, 1.0), (2, 7.5)), Q6_K: ((208, 1.0),)}
_NORMAL, _CONTROL = 1, 3  # llama.cpp token types
# MoE archs whose llama.cpp loader reads the experts' width from expert_feed_forward_length (their
# converter writes it); the others' experts are feed_forward_length wide
_EXPERT_FFN_LENGTH_ARCHES = {"qwen3moe"}


@dataclass(frozen=True)
class _TokenizerStyle:
    specials: tuple[str, ...]  # appended after the ordinary tokens, as CONTROL tokens
    bos: str
    eos: str
    add_bos: bool
    chat_template: str


_TOKENIZER_STYLES = {
    "llama": _TokenizerStyle(
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        add_bos=True,
        chat_template=(
            "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
            "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
        ),
    ),
    "qwen2": _TokenizerStyle(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos="<|endoftext|>",
        eos="<|im_end|>",
        add_bos=False,
        chat_template=(
            "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    ),
    # OLMoE's GPT-NeoX tokenizer, with its Instruct model's Tulu chat template
    "olmoe": _TokenizerStyle(
        ("<|endoftext|>", "<|padding|>"),
        bos="<|endoftext|>",
        eos="<|endoftext|>",
        add_bos=False,
        chat_template=(
            "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + "
            "message['content'] }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
            "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
        ),
    ),
}
_TOKENIZER_STYLES["qwen3moe"] = _TOKENIZER_STYLES["qwen2"]


@dataclass(frozen=True)
class SyntheticShape:
    """A decoder's hyper-parameters, as its GGUF states them; every matrix width whole 256-blocks.

    `experts` > 0 makes it a Mixture of Experts: every layer's FFN is a router over `experts` experts,
    `experts_used` of them per token, each `expert_intermediate` wide (`intermediate` is then only the
    feed_forward_length the GGUF states). `qk_norm` is RMS norms on the queries and keys: "head" one
    [head_dim] weight shared by the heads (Qwen3), "full" one over each whole projection (OLMoE).
    """

    name: str
    arch: Literal["llama", "qwen2", "olmoe", "qwen3moe"]
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    rms_eps: float
    context: int
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0
    qk_norm: Literal["none", "head", "full"] = "none"

    def __post_init__(self) -> None:
        for field in ("hidden", "intermediate", *(("expert_intermediate",) if self.experts else ())):
            if getattr(self, field) % 256:
                raise ValueError(f"SyntheticShape.{field} must be a multiple of 256 (the K-quant block).")
        if self.heads * self.head_dim % 256:
            raise ValueError(
                "SyntheticShape: heads * head_dim (attn_output's width) must be a multiple of 256."
            )
        if self.kv_heads <= 0 or self.heads % self.kv_heads:
            raise ValueError("SyntheticShape.heads must be a positive multiple of kv_heads.")
        if self.vocab < 256 + len(_TOKENIZER_STYLES[self.arch].specials):
            raise ValueError("SyntheticShape.vocab must hold the 256 byte tokens and the special tokens.")
        if (self.experts > 0) != (self.arch in ("olmoe", "qwen3moe")):
            raise ValueError(f"SyntheticShape: arch {self.arch!r} is {'' if self.experts else 'not '}MoE.")
        if self.experts and not (0 < self.experts_used <= self.experts and self.expert_intermediate > 0):
            raise ValueError(
                "SyntheticShape: an MoE needs 0 < experts_used <= experts and expert_intermediate > 0."
            )


@dataclass(frozen=True)
class SyntheticTensor:
    name: str
    shape: tuple[int, ...]  # torch order: [out_features, in_features] for a matrix
    qtype: GGMLQuantizationType

    @property
    def stacked(self) -> bool:
        """A 3-D [experts, rows, cols] tensor, written one expert's matrix at a time."""
        return len(self.shape) == 3

    @property
    def nbytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block_size * type_size


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's llama-quantize rule for the layers whose attn_v and ffn_down Q4_K_M makes Q6_K: the
    first and last eighths of the layers and every third one in between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_plan(shape: SyntheticShape) -> list[SyntheticTensor]:
    """Every tensor in llama.cpp's names and order, typed as its Q4_K_M types them. Dense shapes are
    simplified: attn_v and ffn_down are Q6_K on every other layer (llama.cpp picks about one layer in
    three). MoE shapes follow llama-quantize's rule (`use_more_bits`) for attn_v and ffn_down_exps; the
    router (ffn_gate_inp) stays F32, as llama-quantize leaves it."""
    h, q_rows, kv_rows = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    T = SyntheticTensor
    # a tied embedding is also the output matrix, so it gets the output's type
    plan = [T("token_embd.weight", (shape.vocab, h), Q6_K if shape.tied_embeddings else Q4_K)]
    for i in range(shape.layers):
        if shape.experts:
            more_bits = Q6_K if use_more_bits(i, shape.layers) else Q4_K
        else:
            more_bits = Q6_K if i % 2 == 0 else Q4_K
        plan.append(T(f"blk.{i}.attn_norm.weight", (h,), F32))
        for part, rows, qtype in (
            ("attn_q", q_rows, Q4_K),
            ("attn_k", kv_rows, Q4_K),
            ("attn_v", kv_rows, more_bits),
        ):
            plan.append(T(f"blk.{i}.{part}.weight", (rows, h), qtype))
            if shape.qkv_bias:
                plan.append(T(f"blk.{i}.{part}.bias", (rows,), F32))
        plan.append(T(f"blk.{i}.attn_output.weight", (h, q_rows), Q4_K))
        if shape.qk_norm != "none":
            full = shape.qk_norm == "full"
            plan += [
                T(f"blk.{i}.attn_q_norm.weight", (q_rows if full else shape.head_dim,), F32),
                T(f"blk.{i}.attn_k_norm.weight", (kv_rows if full else shape.head_dim,), F32),
            ]
        plan.append(T(f"blk.{i}.ffn_norm.weight", (h,), F32))
        if shape.experts:
            n, width = shape.experts, shape.expert_intermediate
            plan += [
                T(f"blk.{i}.ffn_gate_inp.weight", (n, h), F32),
                T(f"blk.{i}.ffn_gate_exps.weight", (n, width, h), Q4_K),
                T(f"blk.{i}.ffn_up_exps.weight", (n, width, h), Q4_K),
                T(f"blk.{i}.ffn_down_exps.weight", (n, h, width), more_bits),
            ]
            continue
        plan += [
            T(f"blk.{i}.ffn_gate.weight", (shape.intermediate, h), Q4_K),
            T(f"blk.{i}.ffn_up.weight", (shape.intermediate, h), Q4_K),
            T(f"blk.{i}.ffn_down.weight", (h, shape.intermediate), more_bits),
        ]
    plan.append(T("output_norm.weight", (h,), F32))
    if not shape.tied_embeddings:
        plan.append(T("output.weight", (shape.vocab, h), Q6_K))
    return plan


def write_synthetic_gguf(shape: SyntheticShape, path: Path, seed: int = 0) -> Path:
    """Write `shape` with seeded random weights to `path` (atomically), one tensor in memory at a time.

    Block scales are finite and sized so each matrix's weights have std 1/sqrt(in_features), which keeps
    activations at unit scale from layer to layer and spreads the logits like a trained model's.
    """
    plan = tensor_plan(shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = GGUFWriter(tmp, shape.arch)
        _add_metadata(writer, shape, seed)
        for t in plan:
            if t.qtype == F32:
                writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes)
            else:  # raw blocks: gguf takes the byte shape [..., rows, row_bytes], works out the element shape
                byte_shape = (*t.shape[:-1], t.nbytes // int(np.prod(t.shape[:-1])))
                writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), t.nbytes, t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for index, t in enumerate(plan):
            if t.stacked:  # expert by expert, each from its own seed
                _, rows, cols = t.shape
                parts = (
                    _random_blocks(np.random.default_rng([seed, index, e]), t.qtype, rows, cols)
                    for e in range(t.shape[0])
                )
                _write_tensor_parts(writer, t, parts)
            else:
                writer.write_tensor_data(_random_tensor(np.random.default_rng([seed, index]), t))
        writer.close()
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _write_tensor_parts(writer: GGUFWriter, t: SyntheticTensor, parts: Iterable[np.ndarray]) -> None:
    """`writer.write_tensor_data` for the next tensor, `t`, given as consecutive parts (a 3-D tensor's
    experts), each written out before the next is made: the same alignment padding before and after."""
    assert writer.fout is not None and len(writer.fout) == 1, "a single-file writer"
    fout = writer.fout[0]
    name = next(iter(writer.tensors[0]))
    if name != t.name:
        raise ValueError(f"Tensor {t.name!r} written out of order: the writer expects {name!r}.")
    info = writer.tensors[0].pop(name)
    writer.write_padding(fout, fout.tell())
    written = 0
    for part in parts:
        part.tofile(fout)
        written += part.nbytes
    if written != info.nbytes:
        raise ValueError(f"Tensor {t.name!r}: wrote {written} bytes of {info.nbytes}.")
    writer.write_padding(fout, written)
    writer.state = WriterState.WEIGHTS


def _random_tensor(rng: np.random.Generator, t: SyntheticTensor) -> np.ndarray:
    """F32: norms of ones, small biases, routers of std 1/sqrt(hidden) (unit-scale logits, so tokens
    spread over the experts). K-quants: `[rows, row_bytes]` random blocks with finite scales."""
    if t.qtype == F32:
        if t.name.endswith(".bias"):
            return rng.normal(0.0, 0.02, size=t.shape).astype(np.float32)
        if t.name.endswith(".ffn_gate_inp.weight"):
            return rng.normal(0.0, t.shape[-1] ** -0.5, size=t.shape).astype(np.float32)
        return np.ones(t.shape, dtype=np.float32)
    rows, cols = t.shape
    return _random_blocks(rng, t.qtype, rows, cols)


def _random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, rows: int, cols: int) -> np.ndarray:
    """A `[rows, row_bytes]` matrix of random `qtype` blocks whose finite scales give std 1/sqrt(cols)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = cols // block_size
    blocks = rng.integers(0, 256, size=(rows, n_blocks, type_size), dtype=np.uint8)
    # per-block d within ±50% of the one that gives std 1/sqrt(cols)
    d = rng.uniform(0.5, 1.5, size=(rows, n_blocks)) * (cols**-0.5 / _STD_PER_D[qtype])
    for offset, factor in _SCALE_FIELDS[qtype]:
        scale = (d * factor).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(rows, n_blocks, 2)
    return blocks.reshape(rows, n_blocks * type_size)


def _add_metadata(writer: GGUFWriter, shape: SyntheticShape, seed: int) -> None:
    writer.add_name(f"synthetic {shape.name}")
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_K_M)
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    if shape.head_dim != shape.hidden // shape.heads:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        if shape.arch in _EXPERT_FFN_LENGTH_ARCHES:
            writer.add_expert_feed_forward_length(shape.expert_intermediate)

    style = _TOKENIZER_STYLES[shape.arch]
    tokens, merges = synthetic_vocab(shape.vocab - len(style.specials), seed)
    tokens += style.specials
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([_NORMAL] * (len(tokens) - len(style.specials)) + [_CONTROL] * len(style.specials))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(style.bos))
    writer.add_eos_token_id(tokens.index(style.eos))
    writer.add_add_bos_token(style.add_bos)
    writer.add_chat_template(style.chat_template)


def synthetic_vocab(size: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """`size` byte-level BPE tokens and their merges: GPT-2's 256 byte characters, then tokens each made
    by appending a lowercase letter to a word start (a letter or a space, "Ġ") or an earlier such token."""
    byte_chars = _gpt2_byte_chars()
    tokens = list(byte_chars)
    seen = set(tokens)
    letters = [byte_chars[b] for b in b"abcdefghijklmnopqrstuvwxyz"]
    stems = [byte_chars[ord(" ")], *letters]
    merges: list[str] = []
    rng = np.random.default_rng(seed)
    while len(tokens) < size:
        picks = rng.random((size, 2))
        for stem_pick, letter_pick in picks:
            stem, letter = stems[int(stem_pick * len(stems))], letters[int(letter_pick * len(letters))]
            token = stem + letter
            if token in seen:
                continue
            seen.add(token)
            tokens.append(token)
            stems.append(token)
            merges.append(f"{stem} {letter}")
            if len(tokens) == size:
                break
    return tokens, merges


def _gpt2_byte_chars() -> list[str]:
    """The character GPT-2's byte-level BPE spells each byte with: itself if printable, else 256 + n."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    chars, unprintable = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + unprintable))
            unprintable += 1
    return chars
