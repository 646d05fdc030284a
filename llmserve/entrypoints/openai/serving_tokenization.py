"""`POST /tokenize` and `POST /detokenize`, with the tokenizer and chat template the engine uses, under
the size limits of generation: a text no prompt of max_model_len tokens can spell is refused before it
is tokenized, and no more than max_model_len tokens are decoded, so one call's work is bounded like a
completion's preparation."""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import Executor

from llmserve.engine.async_llm import AsyncLLM
from llmserve.entrypoints.openai.errors import OpenAIError
from llmserve.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from llmserve.entrypoints.openai.responses import DetokenizeResponse, TokenizeResponse
from llmserve.entrypoints.openai.serving_engine import OpenAIServing
from llmserve.entrypoints.openai.serving_models import ServedModels


class OpenAIServingTokenization(OpenAIServing):
    """Encodes and decodes with its own copy of the tokenizer, on its own executor: a fast tokenizer is
    not to be used from two threads at once (truncating a prompt reconfigures it), and these open routes
    must not wait behind, or hold up, the preparation of the engine's requests. (Chat messages are
    rendered to text by the engine's chat template, which only reads the tokenizer.)"""

    def __init__(
        self, engine: AsyncLLM, models: ServedModels, stopping: asyncio.Event, executor: Executor | None
    ) -> None:
        super().__init__(engine, models, stopping, executor)
        self.tokenizer = copy.deepcopy(engine.tokenizer)

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.models.resolve(request.model)
        if request.messages is not None and request.prompt is None:
            tokens = self.render_chat(
                request.messages,
                request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                chat_template_kwargs=request.chat_template_kwargs,
                add_special_tokens=bool(request.add_special_tokens),
            )["prompt_token_ids"]
        elif request.prompt is not None and request.messages is None:
            self.check_prompt_chars(len(request.prompt), "prompt")
            add_special_tokens = request.add_special_tokens is not False
            tokens = self.tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens)
        else:
            raise OpenAIError("Give exactly one of 'prompt' and 'messages'.", param="prompt")
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.engine.limits.max_model_len, tokens=tokens
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.resolve(request.model)
        max_len = self.engine.limits.max_model_len
        if len(request.tokens) > max_len:
            raise OpenAIError(
                f"{len(request.tokens)} tokens are more than max_model_len ({max_len}): decode fewer.",
                param="tokens",
            )
        vocab_size = self.engine.limits.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"Token id {bad} is out of vocabulary (size {vocab_size}).", param="tokens")
        return DetokenizeResponse(prompt=str(self.tokenizer.decode(request.tokens)))
