"""The model names the server answers to (`--served-model-name`) and `/v1/models`."""

from __future__ import annotations

from collections.abc import Sequence

from llmserve.entrypoints.openai.errors import model_not_found
from llmserve.entrypoints.openai.responses import ModelCard, ModelList


class ServedModels:
    """One model under one or more names; a request without `model` gets the first name."""

    def __init__(self, names: Sequence[str], root: str, max_model_len: int) -> None:
        if not names or any(not name for name in names):
            raise ValueError("served_model_name needs at least one non-empty name.")
        self.names = list(names)
        self.root = root
        self.max_model_len = max_model_len

    def resolve(self, requested: str | None) -> str:
        """The name to answer with; 404 (`model_not_found`) for a name this server does not serve."""
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            raise model_not_found(requested)
        return requested

    def card(self, name: str) -> ModelCard:
        return ModelCard(id=self.resolve(name), root=self.root, max_model_len=self.max_model_len)

    def list(self) -> ModelList:
        return ModelList(data=[self.card(name) for name in self.names])
