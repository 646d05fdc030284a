"""The token embedding read from its stored rows: a lookup widens only the rows it needs."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.model_executor.layers.stored_weight import StoredTensor


class StoredEmbedding(nn.Module):
    """`nn.Embedding` over a `StoredTensor` [vocab, hidden], set by the loader. With tied embeddings the
    output projection multiplies the same tensor, so the matrix is in memory once."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.table: StoredTensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] int64 → [n, embedding_dim] fp32."""
        assert self.table is not None, "load the weights first"
        return self.table.dequantize(ids)
