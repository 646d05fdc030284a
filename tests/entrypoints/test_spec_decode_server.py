"""`llmserve serve --speculative-config` with the real default model and the `openai` client: the same
tokens as a server without it, streamed or not, and vLLM's spec_decode counters in /metrics."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from llmserve.entrypoints.cli import build_parser, engine_args_from
from tests.entrypoints.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.remote_server import RemoteServer

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
CODE = (Path(__file__).parents[2] / "llmserve/scheduling/request_queue.py").read_text()[:1200]
MESSAGES = [{"role": "user", "content": f"{CODE}\n\nRewrite this code, renaming RequestQueue to Queue."}]


@pytest.fixture(scope="module")
def spec_server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer([*SERVER_ARGS, "--speculative-config", json.dumps(SPEC)])
    yield remote
    remote.stop()


def chat(server: RemoteServer, stream: bool) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0.0)
    if not stream:
        response = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        return response.choices[0].message.content, response.usage.completion_tokens
    chunks = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})  # type: ignore[call-overload]
    text, tokens = "", 0
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return text, tokens


def counter(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", metrics, re.M))


def test_outputs_match_a_server_without_speculation(server: RemoteServer, spec_server: RemoteServer) -> None:
    want = chat(server, stream=False)
    assert chat(spec_server, stream=False) == want
    assert chat(spec_server, stream=True) == want
    metrics = httpx.get(f"{spec_server.url}/metrics").text
    drafted = counter(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = counter(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name' in metrics
    assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"method": "ngram"', "not valid JSON"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_mn": 1}', "prompt_lookup_mn"),
    ],
)
def test_a_bad_flag_names_the_problem(value: str, message: str) -> None:
    args = engine_args_from(build_parser().parse_args(["serve", "--speculative-config", value]))
    with pytest.raises(ValueError, match=message):
        args.create_engine_config()


def test_the_flag_reaches_the_engine_config() -> None:
    args = engine_args_from(build_parser().parse_args(["serve", "--speculative-config", json.dumps(SPEC)]))
    config = args.create_engine_config().speculative_config
    assert config is not None and (config.num_speculative_tokens, config.prompt_lookup_min) == (3, 2)
