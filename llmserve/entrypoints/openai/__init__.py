"""The OpenAI-compatible HTTP server (`llmserve serve`) on top of `AsyncLLM`."""
