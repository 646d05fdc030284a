"""llmserve: run and serve large language models."""

from llmserve.entrypoints.llm import LLM
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestOutputKind"]
__version__ = "0.1.0"
