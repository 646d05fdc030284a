"""Opening a model on disk: where it is, its config, its tokenizer, its weights (in HF names).

The front end needs only the tokenizer and the config; the engine core needs the config and the
weights. Each is loaded on its own so neither process pays for what it does not use: this package
exports only what the front end reads (which imports no torch); the engine core imports
`loader.weights` (`load_model_config`, `iter_weights`) itself.
"""

from llmserve.model_executor.loader.model_source import ModelSource, resolve_model
from llmserve.model_executor.loader.tokenizer import load_tokenizer

__all__ = ["ModelSource", "resolve_model", "load_tokenizer"]
