"""What the soak benchmark sends and what it reads back: the seeded mix of request shapes, one
request sent as its client would, the server's processes' resident memory and its /metrics gauges."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import psutil

from benchmarks.serving import WORDS

# Of the requests, this share has a prompt that fills the context up to max_tokens (and up to
# LONG_PROMPT_SLACK tokens less): the longest prefill and the most KV blocks one request can hold.
LONG_PROMPT_SHARE = 0.05
LONG_PROMPT_SLACK = 15
# The /metrics gauges the soak follows: the scheduler's batch, its queue and the KV blocks in use.
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


@dataclass(frozen=True)
class Shape:
    """One request of the mix: the endpoint, its body and what the client does with the answer."""

    path: str
    body: dict[str, object]
    expect_status: int
    drop_after_first_chunk: bool


def draw_shape(rng: random.Random, model: str, long_prompt: Sequence[int] = ()) -> Shape:
    """Completions and chat completions, streamed or not; prompts of 2-400 words, or now and then
    (when `long_prompt`, max_model_len token ids, is given) near max_model_len; 1-48 output tokens;
    n = 2 now and then, logprobs now and then; some streams dropped by the client after their first
    chunk; some requests invalid (a 400 expected)."""
    if long_prompt and rng.random() < LONG_PROMPT_SHARE:
        return _long_shape(rng, model, long_prompt)
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 400)))
    stream = rng.random() < 0.6
    body: dict[str, object] = {
        "model": model,
        "max_tokens": rng.randint(1, 48),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": stream,
    }
    if rng.random() < 0.5:
        path, body["prompt"] = "/completions", words
        if rng.random() < 0.2:
            body["logprobs"] = 3
    else:
        path, body["messages"] = "/chat/completions", [{"role": "user", "content": words}]
        if rng.random() < 0.2:
            body["logprobs"], body["top_logprobs"] = True, 3
    if rng.random() < 0.1:
        body["n"] = 2
    expect = 200
    if rng.random() < 0.05:
        body["max_tokens"], expect = -1, 400
    drop = stream and expect == 200 and rng.random() < 0.1
    return Shape(path, body, expect, drop)


def _long_shape(rng: random.Random, model: str, long_prompt: Sequence[int]) -> Shape:
    max_tokens = rng.randint(1, 48)
    prompt = list(long_prompt[: len(long_prompt) - max_tokens - rng.randint(0, LONG_PROMPT_SLACK)])
    stream = rng.random() < 0.6
    body: dict[str, object] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    return Shape("/completions", body, 200, stream and rng.random() < 0.1)


def long_prompt_ids(base_url: str) -> list[int]:
    """max_model_len token ids of plain text, from the server's own /tokenize."""
    root = base_url.removesuffix("/v1")
    text = " ".join(WORDS[i % len(WORDS)] for i in range(4096))
    answer = httpx.post(f"{root}/tokenize", json={"prompt": text}, timeout=60).json()
    ids = answer["tokens"][: answer["max_model_len"]]
    if len(ids) < answer["max_model_len"]:
        raise ValueError(f"{len(ids)} tokens of text cannot fill max_model_len {answer['max_model_len']}")
    return list(ids)


# What `send` returns for a 503 with Retry-After: the server shed the request (its queue limits).
SHED = "shed"


async def send(http: httpx.AsyncClient, base_url: str, shape: Shape) -> str | None:
    """Sends one request; returns what went wrong, `SHED` for an overloaded server's 503 (with
    Retry-After, before any work), or None."""
    try:
        async with http.stream("POST", base_url + shape.path, json=shape.body) as response:
            if response.status_code == 503 and "retry-after" in response.headers:
                await response.aread()
                return SHED
            if response.status_code != shape.expect_status:
                body = (await response.aread())[:200]
                return f"HTTP {response.status_code} (expected {shape.expect_status}): {body!r}"
            if not shape.body["stream"] or response.status_code != 200:
                await response.aread()
                return None
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        # a stream's queue timeout is the server shedding it too
                        return SHED if event["error"].get("code") == "server_overloaded" else (
                            f"error in stream: {line[:200]}"
                        )
                    if shape.drop_after_first_chunk:
                        return None  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        return repr(e)
    return None


def process_rss(pid: int) -> dict[str, int]:
    """Resident bytes of the API server (`pid`) and of each child: the engine core (named by its
    process title) and any other, by pid."""
    root = psutil.Process(pid)
    rss = {"api_server": root.memory_info().rss}
    for child in root.children(recursive=True):
        name = "engine_core" if "EngineCore" in " ".join(child.cmdline()) else f"child {child.pid}"
        rss[name] = rss.get(name, 0) + child.memory_info().rss
    return rss


def parse_gauges(metrics_text: str) -> dict[str, float]:
    """`GAUGES` as /metrics shows them (Prometheus' text format)."""
    names = "|".join(GAUGES)
    found = re.findall(rf"^llmserve:({names})\{{[^}}]*\}} (\S+)$", metrics_text, re.M)
    return {name: float(value) for name, value in found}
