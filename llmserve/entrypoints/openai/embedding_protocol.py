"""`POST /v1/embeddings`: the request and response bodies, as OpenAI defines them, with vLLM's extras."""

from __future__ import annotations

import time
from typing import Annotated, Literal, cast

from pydantic import BaseModel, Field, StrictInt

from llmserve.engine.input_processor import PromptType, TokensPrompt
from llmserve.entrypoints.openai.protocol import OpenAIRequest, TokenIds
from llmserve.pooling_params import PoolingParams

# OpenAI's bound on the inputs of one request.
MAX_EMBEDDING_INPUTS = 2048

EmbeddingInput = Annotated[
    str | list[str] | TokenIds | list[TokenIds],
    Field(description="text, texts, token ids or lists of token ids; one vector per input"),
]


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None  # None: the first served model name
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # refused by models without matryoshka training (all ours)
    user: str | None = None  # ignored, as OpenAI allows
    truncate_prompt_tokens: int | None = None  # vLLM's: keep each input's last k tokens (-1: max_model_len)
    normalize: bool | None = None  # vLLM's: L2-normalise (None: as the model's modules say)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's own ([CLS] ... [SEP] for BERT)
    priority: StrictInt = 0  # vLLM's extra: lower is scheduled first (--scheduling-policy priority only)

    def prompts(self) -> list[PromptType]:
        """Each input on its own; `ValueError` naming `input` for an empty one or too many."""
        given = self.input
        if isinstance(given, str):
            given = [given] if given else []
        if not given:
            raise ValueError("input must not be empty")
        if isinstance(given[0], int):  # one input of token ids
            return [TokensPrompt(prompt_token_ids=cast(list[int], given))]
        if len(given) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"input must hold at most {MAX_EMBEDDING_INPUTS} items, got {len(given)}")
        out: list[PromptType] = []
        for i, item in enumerate(given):
            if not item:
                raise ValueError(f"input[{i}] must not be empty")
            out.append(
                item if isinstance(item, str) else TokensPrompt(prompt_token_ids=cast(list[int], item))
            )
        return out

    def pooling_params(self) -> PoolingParams:
        """Raises `ValueError` naming the field when a value is out of range."""
        return PoolingParams(
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            normalize=self.normalize,
            dimensions=self.dimensions,
        )


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of the little-endian float32 values (encoding_format)
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
