"""Incremental detokenization: text grows token by token, never splitting a multi-byte character."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    """Wraps the tokenizers library's `DecodeStream`, which keeps only a small window of ids, so each
    step costs O(new tokens) rather than re-decoding the whole output."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None:
            raise ValueError("llmserve needs a fast (tokenizers-backed) tokenizer.")
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def decode(self, new_token_ids: list[int]) -> str:
        """The text the new tokens add (may be empty while a character is incomplete)."""
        pieces = []
        for token_id in new_token_ids:
            piece = self._stream.step(self._backend, token_id)
            if piece:
                pieces.append(piece)
        return "".join(pieces)
