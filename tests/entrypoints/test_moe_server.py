"""The server on a Mixture-of-Experts GGUF (the tiny Qwen2-MoE: Q4_K experts and a shared expert), through
the `openai` client: transformers' greedy tokens, and the start-up log's parameters and expert layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import torch
import transformers
from gguf import GGMLQuantizationType

from tests.e2e.greedy_reference import hf_greedy
from tests.entrypoints.remote_server import RemoteServer
from tests.fixtures.tiny_moe import write_moe_gguf, write_tiny_moe
from tests.model_executor.test_moe import mixed_prompts

NUM_TOKENS = 16


def test_the_server_gives_transformers_tokens_on_an_moe_gguf(tmp_path: Path) -> None:
    family, experts = "qwen2_moe", GGMLQuantizationType.Q4_K
    model_dir = write_tiny_moe(tmp_path / "hf", family, expert_type=experts)
    prompts = mixed_prompts(family)[1:3]
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as the requests' ignore_eos
    expected = [hf_greedy(hf, prompt, NUM_TOKENS).token_ids for prompt in prompts]
    gguf = write_moe_gguf(tmp_path / "moe.gguf", model_dir, family, experts)
    args = ["--dtype", "float32", "--kv-cache-memory", str(16 << 20), "--disable-log-stats"]
    server = RemoteServer([str(gguf), *args, "--served-model-name", "tiny-moe"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        for prompt, tokens in zip(prompts, expected, strict=True):
            reply = client.completions.create(
                model="tiny-moe",
                prompt=prompt,
                max_tokens=NUM_TOKENS,
                temperature=0.0,
                logprobs=1,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )
            logprobs = reply.choices[0].logprobs
            assert logprobs is not None and logprobs.tokens is not None
            assert [int(t.removeprefix("token_id:")) for t in logprobs.tokens] == list(tokens)
        assert "8 experts 256 wide, 2 per token, a shared expert 48 wide, in 2 of 2 layers" in server.output()
    finally:
        server.stop()
