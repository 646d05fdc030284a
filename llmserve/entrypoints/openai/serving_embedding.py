"""`POST /v1/embeddings`: one engine (pooling) request per input, every input validated before any runs."""

from __future__ import annotations

import base64
import uuid
from contextlib import aclosing
from functools import partial
from typing import TYPE_CHECKING

from llmserve.engine.input_processor import TokensPrompt
from llmserve.engine.queue_limits import EngineOverloadedError
from llmserve.entrypoints.openai.embedding_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from llmserve.entrypoints.openai.errors import bad_request
from llmserve.entrypoints.openai.serving_engine import OpenAIServing, ServerOverloaded
from llmserve.entrypoints.openai.streaming import merge_streams
from llmserve.pooling_params import PoolingParams

if TYPE_CHECKING:
    import torch

_FIELDS = EmbeddingRequest.model_fields


class OpenAIServingEmbedding(OpenAIServing):
    def _start(self, request: EmbeddingRequest) -> tuple[str, PoolingParams, list[list[int]]]:
        """The model name, the pooling params and each input's tokens; everything that can fail with a
        400/404/503 fails here, before the engine sees any input."""
        model = self.resolve_model(request.model, "pooling")
        try:
            self.engine.config.scheduler_config.check_priority(request.priority)
            params = request.pooling_params()
            prompts = request.prompts()
        except ValueError as e:
            raise bad_request(e, _FIELDS) from e
        if params.truncate_prompt_tokens is None:
            for prompt in prompts:
                if isinstance(prompt, str):
                    self.check_prompt_chars(len(prompt), "input")
        processor = self.engine.input_processor
        token_ids: list[list[int]] = []
        for i, prompt in enumerate(prompts):
            try:
                core_request = processor.process_pooling_inputs(
                    str(i), prompt, params, add_special_tokens=request.add_special_tokens
                )
            except ValueError as e:
                raise bad_request(e, _FIELDS, "input") from e
            token_ids.append(core_request.prompt_token_ids)
        try:
            self.engine.queue.check(len(token_ids), sum(map(len, token_ids)))
        except EngineOverloadedError as e:
            raise ServerOverloaded(str(e)) from e
        return model, params, token_ids

    async def create(self, request: EmbeddingRequest) -> str:
        """The response body (JSON): built here, since FastAPI would validate a returned model again,
        every float of every vector."""
        model, params, token_ids = await self.run_blocking(partial(self._start, request))
        engine_id = f"embd-{uuid.uuid4().hex}"
        # each input is already truncated: its tokens are the prompt
        params = PoolingParams(normalize=params.normalize)
        streams = [
            self.engine.encode(
                TokensPrompt(prompt_token_ids=ids), params, f"{engine_id}-{i}", request.priority
            )
            for i, ids in enumerate(token_ids)
        ]
        vectors: list[torch.Tensor | None] = [None] * len(streams)
        try:
            async with aclosing(merge_streams(streams, self.stopping)) as merged:
                async for i, output in merged:
                    vectors[i] = output.outputs.data
        except EngineOverloadedError as e:
            raise ServerOverloaded(str(e)) from e
        data: list[EmbeddingData] = []
        for i, vector in enumerate(vectors):
            assert vector is not None  # every stream yields its one output, or raises
            data.append(EmbeddingData(embedding=_encode(vector, request.encoding_format), index=i))
        tokens = sum(map(len, token_ids))
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        return EmbeddingResponse(id=engine_id, model=model, data=data, usage=usage).model_dump_json()


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """OpenAI's two encodings: a list of numbers, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
    values: list[float] = vector.tolist()
    return values
