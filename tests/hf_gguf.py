"""transformers reading a GGUF file itself: the weights every Hugging Face reference of the tests uses."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch


def load_hf_gguf(path: Path, **kwargs: Any) -> Any:
    """transformers' fp32 model of the GGUF at `path`, in eval mode."""
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as patch:
        # transformers parses the file's metadata twice, for the config and then for the tensors, each
        # time a numpy view per element of every array (~20 s for a 262k-token vocabulary); the second
        # parse is the first one's, unchanged (the reader only reads).
        patch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, **kwargs
        )
    return model.eval()
