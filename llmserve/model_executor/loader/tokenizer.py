"""The model's tokenizer, as a `transformers` fast tokenizer, from an HF folder or a GGUF file.

transformers can turn a GGUF's metadata into a tokenizer, but it takes ~14 s on a 49k vocabulary.
For the byte-level BPE vocabularies we know (SmolLM2's and Qwen2's among them) we build the same tokenizer
straight from the metadata with the `tokenizers` library in well under a second, and fall back to
transformers for every other kind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from llmserve.model_executor.loader.gguf_file import GGUFHeader, read_gguf_header
from llmserve.model_executor.loader.model_source import ModelSource

# transformers takes ~1.5 s to import and only the front end needs it, not the engine core that
# imports this package for the weights; so it is imported where used.
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# llama.cpp's token types for tokens matched whole in the text: special ones (<|im_end|>), and
# added ones that are not special (<think>), which decoding keeps.
_CONTROL = 3
_USER_DEFINED = 4

# To choose a tokenizer class, AutoTokenizer first builds the model's config from the GGUF, which for
# these architectures means gguf's reader making numpy views of every metadata array: ~20 s for Gemma 3's
# 262k tokens. The class it chooses (GemmaTokenizer) wraps the backend that transformers' conversion
# builds, and the base class takes that backend directly, giving the same ids and text.
_DIRECT_ARCHITECTURES = ("gemma3",)
# llama.cpp `tokenizer.ggml.pre` values whose HF tokenizer.json is Digits(individual) then
# ByteLevel's GPT-2 split (SmolLM2's, StarCoder's); and those that are ByteLevel alone.
_DIGIT_SPLIT_PRE_TYPES = ("smollm", "starcoder", "refact", "codeshell")
_GPT2_PRE_TYPES = ("gpt-2",)
# Qwen2's split (llama.cpp's "qwen2" pre type), before ByteLevel without its own regex. Like llama.cpp
# and transformers' GGUF conversion, no NFC normalisation (HF's own tokenizer.json has one).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def load_tokenizer(source: ModelSource, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The model's fast tokenizer; `chat_template` (the template, or a file holding it) overrides its own."""
    if source.format == "hf":
        tokenizer = _hf_tokenizer(source.path)
    else:
        tokenizer = _gguf_tokenizer(read_gguf_header(source.path))
    if chat_template is not None:
        tokenizer.chat_template = _read_chat_template(chat_template)
    tokenizer.truncation_side = "left"  # as vLLM's: a truncated prompt keeps its last tokens
    return tokenizer


def eos_token_ids(source: ModelSource, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token id that ends generation: a model may state several (e.g. <|eot_id|> and <|eom_id|>)."""
    ids: list[int] = []
    if source.format == "gguf":
        meta = read_gguf_header(source.path).metadata
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            if (value := meta.get(f"tokenizer.ggml.{key}")) is not None:
                ids.append(int(value))
    else:
        generation_config = source.path / "generation_config.json"
        if generation_config.is_file():
            value = json.loads(generation_config.read_text()).get("eos_token_id")
            ids = [int(v) for v in (value if isinstance(value, list) else [value]) if v is not None]
    if not ids and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    return list(dict.fromkeys(ids))


def _read_chat_template(value: str) -> str:
    """Template text is recognised by its Jinja braces or line breaks; anything else must be a file."""
    if any(ch in value for ch in "{}\n"):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template {value!r} is neither a Jinja template nor an existing file.")
    return path.read_text()


def _hf_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"Cannot load a tokenizer from {folder}: {e}") from e
    if not tokenizer.is_fast:
        raise ValueError(f"The tokenizer in {folder} has no fast (tokenizers) version.")
    return tokenizer


def _gguf_tokenizer(header: GGUFHeader) -> PreTrainedTokenizerBase:
    meta = header.metadata
    pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    if meta.get("tokenizer.ggml.model") != "gpt2" or pre_tokenizer is None:
        return _transformers_gguf_tokenizer(header.path, direct=header.architecture in _DIRECT_ARCHITECTURES)

    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"{header.path} has no tokenizer.ggml.tokens, so no tokenizer can be built.")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"{header.path}: {len(tokens)} tokens but {len(token_types)} token types.")
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    kwargs: dict[str, Any] = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        # explicit flags make transformers build the post-processor that adds BOS/EOS
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    # Added tokens are matched whole in the text before BPE runs, as llama.cpp does.
    tokenizer.add_special_tokens(
        {"additional_special_tokens": _added_tokens(tokens, token_types, _CONTROL)},
        replace_extra_special_tokens=False,
    )
    tokenizer.add_tokens(_added_tokens(tokens, token_types, _USER_DEFINED))
    return tokenizer


def _added_tokens(tokens: list[str], token_types: list[int], wanted: int) -> list[AddedToken]:
    special = wanted == _CONTROL
    return [
        AddedToken(token, normalized=False, special=special)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type == wanted
    ]


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer | None:
    """How this vocabulary splits text before BPE, or None for a kind we do not build ourselves."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE_TYPES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRE_TYPES:
        return byte_level
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    return None


def _transformers_gguf_tokenizer(path: Path, direct: bool) -> PreTrainedTokenizerBase:
    """The general (slow) route: transformers' own conversion of the GGUF metadata. `direct`: through
    the base class, skipping AutoTokenizer's choice of class (see _DIRECT_ARCHITECTURES)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loader = PreTrainedTokenizerFast if direct else AutoTokenizer
    try:
        return loader.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"Cannot build a tokenizer from {path}: {e}") from e
