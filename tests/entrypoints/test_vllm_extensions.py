"""vLLM's extensions to the completions and chat requests, against a real server on the default model:
each does what vLLM's does (checked against the tokenizer and the chat template, or against an
equivalent plain request), and its invalid values get a 400 naming it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from llmserve.entrypoints.openai.protocol import MAX_REQUEST_ID_CHARS
from tests.entrypoints.conftest import SERVER_ARGS
from tests.entrypoints.remote_server import RemoteServer
from tests.entrypoints.test_openai_server import _metric

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PREFILL = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    response = http.post(path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    return dict(response.json())


def assert_400(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> str:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def stream_events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name.removeprefix("token_id:"))


def test_return_tokens_as_token_ids(http: httpx.Client, tokenizer: PreTrainedTokenizerBase) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    by_text = post(http, CMPL, body)["choices"][0]
    by_id = post(http, CMPL, {**body, "return_tokens_as_token_ids": True})["choices"][0]
    assert by_id["text"] == by_text["text"]
    ids = [token_id(t) for t in by_id["logprobs"]["tokens"]]
    assert ids[: len(tokenizer.encode(PROMPT))] == tokenizer.encode(PROMPT)  # the echoed prompt's first
    assert tokenizer.decode(ids) == by_text["text"]
    assert by_id["logprobs"]["token_logprobs"] == by_text["logprobs"]["token_logprobs"]
    assert by_id["logprobs"]["text_offset"] == by_text["logprobs"]["text_offset"]
    for top in by_id["logprobs"]["top_logprobs"][1:]:
        assert len(top) == 2 and all(token_id(name) >= 0 for name in top)

    chat = {"messages": QUESTION, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    reply = post(http, CHAT, {**chat, "return_tokens_as_token_ids": True})["choices"][0]
    content = reply["logprobs"]["content"]
    assert tokenizer.decode([token_id(t["token"]) for t in content]) == reply["message"]["content"]
    for t in content:  # bytes stay the token's text
        assert bytes(t["bytes"]).decode() == tokenizer.decode([token_id(t["token"])])
        assert [token_id(top["token"]) for top in t["top_logprobs"]][0] == token_id(t["token"])
    streamed = stream_events(http, CHAT, {**chat, "return_tokens_as_token_ids": True})
    names = [
        t["token"]
        for e in streamed
        if e["choices"]
        for t in (e["choices"][0]["logprobs"] or {}).get("content") or []
    ]
    assert names == [t["token"] for t in content]


def test_server_flag_makes_token_ids_the_default(tokenizer: PreTrainedTokenizerBase) -> None:
    remote = RemoteServer([*SERVER_ARGS, "--return-tokens-as-token-ids"])
    try:
        with httpx.Client(base_url=remote.url, timeout=120) as http:
            body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": 1}
            by_id = post(http, CMPL, body)["choices"][0]
            assert tokenizer.decode([token_id(t) for t in by_id["logprobs"]["tokens"]]) == by_id["text"]
            by_text = post(http, CMPL, {**body, "return_tokens_as_token_ids": False})["choices"][0]
            assert "".join(by_text["logprobs"]["tokens"]) == by_text["text"]
    finally:
        remote.stop()


def test_continue_final_message_and_echo(http: httpx.Client, tokenizer: PreTrainedTokenizerBase) -> None:
    rendered = tokenizer.apply_chat_template(PREFILL, tokenize=False, continue_final_message=True)
    assert str(rendered).endswith("<|im_start|>assistant\nThe capital of France is")
    body = {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True}
    chat = post(http, CHAT, {**body, "max_tokens": 5, "temperature": 0})
    plain = post(http, CMPL, {"prompt": str(rendered), "max_tokens": 5, "temperature": 0})
    assert chat["usage"]["prompt_tokens"] == len(tokenizer.encode(str(rendered), add_special_tokens=False))
    assert chat["choices"][0]["message"]["content"] == plain["choices"][0]["text"]

    echoed = post(http, CHAT, {**body, "max_tokens": 5, "temperature": 0, "echo": True})
    assert (
        echoed["choices"][0]["message"]["content"] == "The capital of France is" + plain["choices"][0]["text"]
    )
    events = stream_events(http, CHAT, {**body, "max_tokens": 5, "temperature": 0, "echo": True})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == echoed["choices"][0]["message"]["content"]
    # echo repeats only the replying role's message: after a user's, nothing
    question = post(http, CHAT, {"messages": QUESTION, "max_tokens": 3, "temperature": 0})
    again = post(http, CHAT, {"messages": QUESTION, "max_tokens": 3, "temperature": 0, "echo": True})
    assert again["choices"][0]["message"]["content"] == question["choices"][0]["message"]["content"]

    assert_400(http, CHAT, {"messages": PREFILL, "continue_final_message": True}, "continue_final_message")
    message = assert_400(http, CHAT, {**body, "messages": QUESTION}, "continue_final_message")
    assert "assistant" in message


def test_add_generation_prompt_false_and_tokenize(
    http: httpx.Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    rendered = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=False)
    expected = tokenizer.encode(str(rendered), add_special_tokens=False)
    chat = post(http, CHAT, {"messages": QUESTION, "add_generation_prompt": False, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == len(expected)
    tokens = post(http, "/tokenize", {"messages": QUESTION, "add_generation_prompt": False})["tokens"]
    assert tokens == expected
    opened = post(
        http,
        "/tokenize",
        {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True},
    )["tokens"]
    assert str(tokenizer.decode(opened)).endswith("assistant\nThe capital of France is")
    # harmless template variables are accepted; the template call's own arguments are not variables
    kwargs = post(
        http,
        CHAT,
        {"messages": QUESTION, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert kwargs["usage"] == post(http, CHAT, {"messages": QUESTION, "max_tokens": 1})["usage"]
    for body in (
        {"messages": QUESTION, "chat_template_kwargs": {"tokenize": True}},
        {"messages": QUESTION, "chat_template_kwargs": {"add_generation_prompt": False}},
    ):
        assert_400(http, CHAT, body, "chat_template_kwargs")
        assert_400(http, "/tokenize", body, "chat_template_kwargs")
    documents = post(
        http, CHAT, {"messages": QUESTION, "max_tokens": 1, "documents": [{"title": "a", "text": "b"}]}
    )
    assert documents["usage"] == kwargs["usage"]  # this model's template has no documents section


def test_truncate_prompt_tokens(http: httpx.Client, tokenizer: PreTrainedTokenizerBase) -> None:
    long = "Paris is the capital and largest city of France. " * 40
    ids = tokenizer.encode(long)
    out = post(http, CMPL, {"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": 7, "echo": True})
    assert out["usage"]["prompt_tokens"] == 7
    assert out["choices"][0]["text"].startswith(tokenizer.decode(ids[-7:]))
    tokens = post(http, CMPL, {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 7})
    assert tokens["usage"]["prompt_tokens"] == 7
    unchanged = post(http, CMPL, {"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert unchanged["usage"]["prompt_tokens"] == len(tokenizer.encode(PROMPT))
    chat = post(http, CHAT, {"messages": QUESTION, "max_tokens": 1, "truncate_prompt_tokens": 3})
    assert chat["usage"]["prompt_tokens"] == 3
    # truncation takes what the character bound would refuse untruncated
    huge = "word " * 200_000
    refused = assert_400(http, CMPL, {"prompt": huge, "max_tokens": 1}, "prompt")
    assert "characters long" in refused
    assert (
        post(http, CMPL, {"prompt": huge, "max_tokens": 1, "truncate_prompt_tokens": 4})["usage"][
            "prompt_tokens"
        ]
        == 4
    )
    message = assert_400(
        http, CMPL, {"prompt": PROMPT, "truncate_prompt_tokens": 1025}, "truncate_prompt_tokens"
    )
    assert "max_model_len (1024)" in message
    assert_400(http, CMPL, {"prompt": PROMPT, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")
    assert_400(http, CHAT, {"messages": QUESTION, "truncate_prompt_tokens": 1025}, "truncate_prompt_tokens")


def test_long_chat_is_refused_before_tokenizing(http: httpx.Client) -> None:
    huge = [{"role": "user", "content": "word " * 200_000}]
    message = assert_400(http, CHAT, {"messages": huge, "max_tokens": 1}, "messages")
    assert "characters long" in message


async def test_request_ids_from_the_body_and_the_header(server: RemoteServer) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        # the same id twice at once: the engine's own ids stay distinct
        same = [
            client.post(CMPL, json={"prompt": PROMPT, "max_tokens": 4, "request_id": "mine"})
            for _ in range(2)
        ]
        chat_header = client.post(
            CHAT,
            json={"messages": QUESTION, "max_tokens": 1, "request_id": "body"},
            headers={"X-Request-Id": "head"},
        )
        responses = await asyncio.gather(*same, chat_header)
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert [r.json()["id"] for r in responses] == ["cmpl-mine", "cmpl-mine", "chatcmpl-head"]
    assert "x-request-id" not in responses[0].headers
    assert responses[2].headers["x-request-id"] == "head"


def test_request_id_header_on_streams_and_errors(http: httpx.Client) -> None:
    with http.stream(
        "POST",
        CHAT,
        json={"messages": QUESTION, "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "s1"},
    ) as response:
        assert response.headers["x-request-id"] == "s1"
        ids = {json.loads(line[6:])["id"] for line in response.iter_lines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-s1"}
    bad = http.post(CMPL, json={"prompt": PROMPT, "temperature": -1}, headers={"X-Request-Id": "e1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "e1"
    assert_400(http, CMPL, {"prompt": PROMPT, "request_id": "x" * (MAX_REQUEST_ID_CHARS + 1)}, "request_id")
    long = http.post(
        CMPL, json={"prompt": PROMPT}, headers={"X-Request-Id": "x" * (MAX_REQUEST_ID_CHARS + 1)}
    )
    assert long.status_code == 400 and long.json()["error"]["param"] == "X-Request-Id"


@pytest.mark.parametrize(
    ("path", "field", "harmless", "refused"),
    [
        (CMPL, "use_beam_search", False, True),
        (CHAT, "use_beam_search", False, True),
        (CMPL, "length_penalty", 1.0, 0.5),
        (CMPL, "spaces_between_special_tokens", True, False),
        (CHAT, "best_of", 1, 2),
    ],
)
def test_accepted_only_where_they_change_nothing(
    http: httpx.Client, path: str, field: str, harmless: object, refused: object
) -> None:
    base: dict[str, Any] = {"prompt": PROMPT} if path == CMPL else {"messages": QUESTION}
    post(http, path, {**base, "max_tokens": 1, field: harmless})
    assert_400(http, path, {**base, "max_tokens": 1, field: refused}, field)


def test_cache_salt_keeps_prefix_cache_blocks_to_their_salt(
    http: httpx.Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    """vLLM's `cache_salt`: one long prompt (several 16-token blocks, the server's default) under salt
    a, then b, then none, then a again; only the last finds cached blocks, every whole block but the
    last token's. Chat takes it too; an empty salt is a 400 naming it."""
    prompt = "Cache salt test: " + " ".join(f"item{i}" for i in range(60))
    n = len(tokenizer.encode(prompt))
    assert n > 4 * 16

    def counters() -> tuple[float, float]:
        text = http.get("/metrics").text
        return _metric(text, "prefix_cache_queries_total"), _metric(text, "prefix_cache_hits_total")

    deltas = []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
        before = counters()
        body = {"prompt": prompt, "max_tokens": 1, **({} if salt is None else {"cache_salt": salt})}
        assert post(http, CMPL, body)["usage"]["prompt_tokens"] == n
        deltas.append(tuple(a - b for a, b in zip(counters(), before, strict=True)))
    assert deltas == [(n, 0), (n, 0), (n, 0), (n, (n - 1) // 16 * 16)]

    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    post(http, CHAT, {**chat, "cache_salt": "tenant-c"})
    before = counters()
    post(http, CHAT, {**chat, "cache_salt": "tenant-d"})
    assert counters()[1] == before[1]
    post(http, CHAT, {**chat, "cache_salt": "tenant-c"})
    assert counters()[1] > before[1]

    for path, base in ((CMPL, {"prompt": PROMPT}), (CHAT, {"messages": QUESTION})):
        message = assert_400(http, path, {**base, "max_tokens": 1, "cache_salt": ""}, "cache_salt")
        assert "non-empty" in message
