"""Hostile request bodies against a real server on the default model: integers past int64, non-finite
floats, lone surrogates, booleans as token ids, contexts past max_model_len and oversized fan-outs.
Each gets a 400 in OpenAI's error shape naming the field (never a 500, a hang or a silent cut), and
the server keeps serving with nothing left running. Bodies are sent as raw JSON text, so that the
values reach the server exactly as written."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from llmserve.entrypoints.openai.protocol import MAX_N, MAX_SEQUENCES_PER_REQUEST
from tests.entrypoints.remote_server import RemoteServer
from tests.entrypoints.test_openai_server import _metric

ERROR_FIELDS = {"message", "type", "param", "code"}
HUGE = 2**70
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = '[{"role": "user", "content": "hi"}]'


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def completion(extra: str, prompt: str = '"x"') -> str:
    """A completions body as JSON text: `extra` is spliced in verbatim (NaN, 1e999, 2**70, \\ud800)."""
    return f'{{"prompt": {prompt}, "max_tokens": 1{", " if extra else ""}{extra}}}'


def chat(extra: str, messages: str = MESSAGES) -> str:
    return f'{{"messages": {messages}, "max_tokens": 1{", " if extra else ""}{extra}}}'


def assert_400_naming(http: httpx.Client, path: str, body: str, field: str) -> dict[str, Any]:
    """A 400 whose error has OpenAI's four fields and names `field` in its param or message."""
    # A fresh connection each time: after a 500 the server closes the one it answered on.
    response = http.post(
        path, content=body, headers={"Content-Type": "application/json", "Connection": "close"}
    )
    assert response.status_code == 400, (body, response.text)
    error = response.json()["error"]
    assert set(error) == ERROR_FIELDS and error["type"] == "invalid_request_error", response.text
    assert field in (error["param"] or "") or field in error["message"], (body, error)
    return dict(error)


def assert_still_serving(http: httpx.Client) -> None:
    response = http.post(CMPL, json={"prompt": "x", "max_tokens": 1})
    assert response.status_code == 200, response.text


INT_FIELDS: list[tuple[str, str, str]] = [
    (CMPL, completion(f'"seed": {HUGE}'), "seed"),
    (CMPL, completion(f'"seed": {2**64 - 1}'), "seed"),
    (CMPL, completion(f'"seed": {-(2**63) - 1}'), "seed"),
    (CMPL, f'{{"prompt": "x", "max_tokens": {10**30}}}', "max_tokens"),
    (CHAT, f'{{"messages": {MESSAGES}, "max_completion_tokens": {10**30}}}', "max_completion_tokens"),
    (CMPL, completion(f'"top_k": {HUGE}'), "top_k"),
    (CMPL, completion(f'"n": {HUGE}'), "n"),
    (CHAT, chat(f'"n": {HUGE}'), "n"),
    (CMPL, completion(f'"logprobs": {HUGE}'), "logprobs"),
    (CMPL, completion(f'"prompt_logprobs": {HUGE}'), "prompt_logprobs"),
    (CHAT, chat(f'"logprobs": true, "top_logprobs": {HUGE}'), "top_logprobs"),
    (CHAT, chat(f'"min_tokens": {HUGE}'), "min_tokens"),
    (CMPL, completion(f'"logit_bias": {{"{HUGE}": 1}}'), "logit_bias"),
    (CMPL, completion('"logit_bias": {"5": 1e999}'), "logit_bias"),
    (CMPL, completion("", prompt=f"[{HUGE}]"), "prompt"),
    (CMPL, completion("", prompt=f"[[1, 2], [{HUGE}]]"), "prompt"),
    (CMPL, completion("", prompt="[-1]"), "prompt"),
    (CMPL, completion(f'"allowed_token_ids": [{HUGE}]'), "allowed_token_ids"),
    (CMPL, completion('"allowed_token_ids": [49152]'), "allowed_token_ids"),  # the vocabulary's size
    (CMPL, completion(f'"stop_token_ids": [{HUGE}]'), "stop_token_ids"),
    ("/detokenize", f'{{"tokens": [{HUGE}]}}', "tokens"),
]


@pytest.mark.parametrize(("path", "body", "field"), INT_FIELDS)
def test_integers_out_of_range_are_400s(http: httpx.Client, path: str, body: str, field: str) -> None:
    assert_400_naming(http, path, body, field)


def test_the_largest_seed_with_n_2_runs(http: httpx.Client) -> None:
    """Child seeds are seed + i, wrapped into int64: the second child must not overflow."""
    body = completion(f'"seed": {2**63 - 1}, "n": 2, "temperature": 1.0')
    response = http.post(CMPL, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


def test_a_failed_n_2_request_leaves_nothing_running(http: httpx.Client) -> None:
    """Before validation covered the children's seeds, the first child of this request was submitted
    and the second failed to encode: a 500, and a child generating 1,000 tokens for nobody. Whatever
    the machine's speed, such a child shows in the tokens generated after the failure."""
    assert_still_serving(http)  # so that the counters exist
    generated = _metric(http.get("/metrics").text, "generation_tokens_total")
    body = completion(f'"seed": {2**64 - 1}, "n": 2, "temperature": 1.0, "ignore_eos": true')
    assert_400_naming(http, CMPL, body.replace('"max_tokens": 1', '"max_tokens": 1000'), "seed")
    assert_still_serving(http)  # one token, and a step after the failure, so the gauges are fresh
    deadline = time.monotonic() + 5
    while (
        _metric(metrics := http.get("/metrics").text, "num_requests_running") and time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert _metric(metrics, "num_requests_running") == 0
    assert _metric(metrics, "num_requests_waiting") == 0
    assert _metric(metrics, "generation_tokens_total") == generated + 1


SURROGATE = '"a\\ud800b"'  # JSON text: the escape reaches the server, not a Python str


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CMPL, completion("", prompt=SURROGATE), "prompt"),
        (CMPL, completion("", prompt=f'["ok", {SURROGATE}]'), "prompt"),
        (CHAT, chat("", messages=f'[{{"role": "user", "content": {SURROGATE}}}]'), "messages[0].content"),
        (
            CHAT,
            chat("", messages=f'[{{"role": "user", "content": [{{"type": "text", "text": {SURROGATE}}}]}}]'),
            "messages[0].content",
        ),
        (CMPL, completion(f'"stop": {SURROGATE}'), "stop"),
        (CMPL, completion(f'"stop": ["ok", {SURROGATE}]'), "stop"),
        (CMPL, completion(f'"bad_words": [{SURROGATE}]'), "bad_words"),
        ("/tokenize", f'{{"prompt": {SURROGATE}}}', "prompt"),
    ],
)
def test_lone_surrogates_are_400s(http: httpx.Client, path: str, body: str, field: str) -> None:
    assert_400_naming(http, path, body, field)


FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
def test_non_finite_floats_are_400s(http: httpx.Client, value: str) -> None:
    for field in FLOAT_FIELDS:
        assert_400_naming(http, CMPL, completion(f'"{field}": {value}'), field)
        assert_400_naming(http, CHAT, chat(f'"{field}": {value}'), field)
    assert_400_naming(http, CMPL, completion(f'"logit_bias": {{"5": {value}}}'), "logit_bias")


@pytest.mark.parametrize("temperature", ["1.00001e-5", "0.5", "1e4", "1e38", "1e39", "1e300"])
def test_allowed_token_ids_hold_at_every_temperature(
    http: httpx.Client, tokenizer: PreTrainedTokenizerBase, temperature: str
) -> None:
    """Past fp32's range (1e39) a temperature became inf, and the mask's -inf / inf a NaN."""
    allowed = [314, 1034, 2011]
    extra = f'"temperature": {temperature}, "allowed_token_ids": {allowed}, "ignore_eos": true, "logprobs": 0'
    body = completion(extra).replace('"max_tokens": 1', '"max_tokens": 8')
    response = http.post(CMPL, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 8
    assert set(tokens) <= {tokenizer.decode([t]) for t in allowed}, tokens


def test_prompt_plus_max_tokens_past_the_context_is_a_400(
    http: httpx.Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    """vLLM's check and message, rather than a completion silently cut at max_model_len."""
    prompt_len = len(tokenizer.encode("x"))
    error = assert_400_naming(
        http, CMPL, f'{{"prompt": "x", "max_tokens": {1025 - prompt_len}}}', "max_tokens"
    )
    assert error["message"].startswith("This model's maximum context length is 1024 tokens. However, you ")
    assert f"({prompt_len} in the messages, {1025 - prompt_len} in the completion)" in error["message"]
    body = completion("", prompt='["x", "' + "hello " * 600 + '"]').replace(
        '"max_tokens": 1', '"max_tokens": 500'
    )
    assert_400_naming(http, CMPL, body, "max_tokens")
    for field in ("max_tokens", "max_completion_tokens"):
        error = assert_400_naming(http, CHAT, f'{{"messages": {MESSAGES}, "{field}": 1024}}', field)
        assert error["param"] == field and "maximum context length is 1024" in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (CMPL, completion("", prompt="[true, false]"), "prompt"),
        (CMPL, completion("", prompt="[[1, 2], [true]]"), "prompt"),
        (CMPL, completion('"stop_token_ids": [true]'), "stop_token_ids"),
        (CMPL, completion('"allowed_token_ids": [false]'), "allowed_token_ids"),
        ("/detokenize", '{"tokens": [true]}', "tokens"),
    ],
)
def test_booleans_are_not_token_ids(http: httpx.Client, path: str, body: str, field: str) -> None:
    assert_400_naming(http, path, body, field)


def test_fan_out_caps(http: httpx.Client) -> None:
    error = assert_400_naming(http, CMPL, '{"prompt": "x", "n": 1000, "max_tokens": 8000}', "n")
    assert str(MAX_N) in error["message"]
    assert_400_naming(http, CHAT, f'{{"messages": {MESSAGES}, "n": {MAX_N + 1}}}', "n")
    prompts = json.dumps(["x"] * 100)
    error = assert_400_naming(http, CMPL, completion('"n": 100', prompt=prompts), "n")
    assert str(MAX_SEQUENCES_PER_REQUEST) in error["message"]
    over = json.dumps(["x"] * (MAX_SEQUENCES_PER_REQUEST // 2 + 1))
    assert_400_naming(http, CMPL, completion('"n": 2', prompt=over), "n")
    assert_still_serving(http)
