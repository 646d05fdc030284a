"""The server fuzzed through its own /openapi.json (schemathesis): every operation, a few hundred cases
from a fixed seed, bodies that fit the published schema and bodies that break it. Every answer must be
what /openapi.json documents (status, content type, body), never a 5xx, and every 4xx must be OpenAI's
error body. Afterwards the engine gives a fixed greedy request the same answer as before the fuzzing,
with nothing left running or waiting.

The server's max_model_len is small, so that no fuzzed max_tokens, n or prompt makes a case slow.
Schema-valid bodies may still be refused (400): what depends on the model (the vocabulary, the context
length) or ties fields together (/tokenize's prompt or messages) is not in the schema."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.strategies import SearchStrategy
from schemathesis import APIOperation, Case, GenerationMode
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.entrypoints.remote_server import RemoteServer
from tests.entrypoints.test_openai_server import _metric

MODEL = "smollm2-135m-instruct"
SERVER_ARGS = ["--kv-cache-memory", str(64 << 20), "--max-model-len", "128", "--disable-log-stats",
               "--uvicorn-log-level", "warning"]  # fmt: skip
SEED = 14
# Per operation and mode (schema-valid, schema-breaking): a few hundred cases in all.
FUZZ_EXAMPLES = 40
MIN_CASES = 300
GREEDY = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 12, "temperature": 0.0}
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def fuzz_server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer(SERVER_ARGS)
    yield remote
    remote.stop()


def greedy_answer(server: RemoteServer) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/completions", json=GREEDY, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    return {"text": choice["text"], "finish_reason": choice["finish_reason"], "usage": body["usage"]}


def load_operations(server: RemoteServer) -> list[APIOperation]:
    # Streams read to the end (schemathesis stops at 64 events by default), each within a minute.
    config = schemathesis.Config.from_dict({"seed": SEED, "request-timeout": 60, "max-stream-events": 10**6})
    loaded = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)
    results = list(loaded.get_all_operations())
    assert all(isinstance(result, Ok) for result in results), results  # every operation's schema parses
    return [result.ok() for result in results if isinstance(result, Ok)]


def assert_openai_error(status: int, content: bytes) -> None:
    """Exactly `{"error": {message, type, param, code}}`, with their types, for a 4xx."""
    body = json.loads(content)
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, (status, body)
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert error["type"] == "invalid_request_error", body
    assert all(error[key] is None or isinstance(error[key], str) for key in ("param", "code")), body


def openai_answer(response: schemathesis.Response) -> None:
    """No 5xx; every 4xx in OpenAI's error shape; a stream ends with [DONE] and carries no error event
    (an error after the 200 went out is the server's fault here)."""
    status = response.status_code
    assert status < 500, f"{status}: {response.content[:500]!r}"
    if status >= 400:
        assert_openai_error(status, response.content)
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        assert not response.stream_cut_short, "the stream did not end within the request timeout"
        events = [line for line in response.content.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", events[-3:]
        assert not any("error" in json.loads(event[6:]) for event in events[:-1]), events[:3]


def fuzz(strategy: SearchStrategy[Case], statuses: Counter[int]) -> None:
    """FUZZ_EXAMPLES cases of `strategy`, each sent and its answer checked against the schema (all of
    schemathesis's checks but one, see the module's docstring) and `openai_answer`."""

    @given(case=strategy)
    @settings(
        max_examples=FUZZ_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def send(case: Case) -> None:
        response = case.call()
        statuses[response.status_code] += 1
        openai_answer(response)
        case.validate_response(response, excluded_checks=[positive_data_acceptance])

    send()


def test_fuzzed_requests_get_documented_answers_and_leave_the_engine_unchanged(
    fuzz_server: RemoteServer,
) -> None:
    greedy_before = greedy_answer(fuzz_server)
    statuses: Counter[int] = Counter()
    operations = load_operations(fuzz_server)
    assert len(operations) >= 9, [op.label for op in operations]
    for operation in operations:
        # Only a body can break the schema: /v1/models/{name} takes any string.
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)[: 1 + bool(len(operation.body))]:
            fuzz(operation.as_strategy(mode), statuses)
    assert sum(statuses.values()) >= MIN_CASES, statuses
    assert statuses[200] and sum(n for status, n in statuses.items() if 400 <= status < 500), statuses
    assert greedy_answer(fuzz_server) == greedy_before
    metrics = httpx.get(f"{fuzz_server.url}/metrics", timeout=10).text
    assert _metric(metrics, "num_requests_running") == _metric(metrics, "num_requests_waiting") == 0


def test_an_undeclared_method_gets_405_with_allow_in_openai_shape(fuzz_server: RemoteServer) -> None:
    """Found by schemathesis (its unsupported-method check): the 405 lost Starlette's `Allow` header
    when the error was rewritten into OpenAI's shape."""
    paths = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=10).json()["paths"]
    for path, operations in paths.items():
        response = httpx.request("TRACE", fuzz_server.url + path.replace("{name}", MODEL), timeout=10)
        assert response.status_code == 405, (path, response.text)
        allowed = {method.strip() for method in response.headers.get("allow", "").split(",")}
        assert allowed >= {method.upper() for method in operations}, (path, response.headers)
        assert_openai_error(response.status_code, response.content)


def test_the_size_limits_are_published_and_enforced(fuzz_server: RemoteServer) -> None:
    """What the fuzzer generates from: the limits /tokenize, /detokenize and structured outputs
    enforce, from this server's model and flags; one past each is OpenAI's 400 naming the field."""
    components = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=10).json()["components"]["schemas"]

    def bound(model: str, field: str, key: str) -> int:
        prop = components[model]["properties"][field]
        return int(next(m[key] for m in prop.get("anyOf", [prop]) if key in m))

    max_chars = bound("TokenizeRequest", "prompt", "maxLength")
    assert bound("DetokenizeRequest", "tokens", "maxItems") == 128  # max_model_len
    assert (
        bound("StructuredOutputsRequest", "regex", "maxLength")
        == bound("StructuredOutputsRequest", "grammar", "maxLength")
        == 1 << 20
    )
    assert bound("StructuredOutputsRequest", "choice", "maxItems") == 10_000
    over = [
        ("/tokenize", {"prompt": "a" * (max_chars + 1)}, "prompt"),
        ("/detokenize", {"tokens": [1] * 129}, "tokens"),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"choice": ["a"] * 10_001}},
            "structured_outputs.choice",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "structured_outputs": {"regex": "a" * ((1 << 20) + 1)}},
            "structured_outputs.regex",
        ),
    ]
    for path, body, field in over:
        response = httpx.post(fuzz_server.url + path, json=body, timeout=60)
        assert response.status_code == 400, (path, response.text[:300])
        assert_openai_error(response.status_code, response.content)
        assert response.json()["error"]["param"] == field, response.text[:300]
