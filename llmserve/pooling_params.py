"""What to return for a pooling (embedding) request, with vLLM's field names and validation."""

from __future__ import annotations

import msgspec

from llmserve.sampling_params import INT64_MAX


class PoolingParams(msgspec.Struct, omit_defaults=True):
    """Settings of one embedding request. Invalid values raise `ValueError` naming the field.

    `truncate_prompt_tokens`: keep only the prompt's last k tokens (-1: max_model_len), as vLLM does;
    a text prompt keeps its special tokens ([CLS] ... [SEP]) around them. `normalize`: L2-normalise
    the embedding (None: as the model's sentence-transformers modules say). `dimensions`: a shorter
    embedding, for models trained for it (matryoshka); refused by the others.
    A msgspec struct so that it travels to the engine core without pickle.
    """

    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        keep = self.truncate_prompt_tokens
        if keep is not None and not (_is_int(keep) and (keep == -1 or 1 <= keep <= INT64_MAX)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {keep!r}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or null, got {self.normalize!r}.")
        if self.dimensions is not None and not (_is_int(self.dimensions) and self.dimensions >= 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
