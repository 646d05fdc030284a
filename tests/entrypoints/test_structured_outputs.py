"""Structured outputs through a real server on the default model, and offline through `LLM`: OpenAI's
`response_format` and vLLM's `structured_outputs` on both endpoints, each output checked against an
independent reference (`jsonschema`, Python's `re`, a recursive-descent parser of the grammar).

A small model may still be writing a (valid) JSON prefix when `max_tokens` cuts it: the grammar
guarantees every prefix, not that the model closes in time. An output cut by length is counted (and the
count bounded), never validated; every output that stopped must validate."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pydantic
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema

from llmserve import LLM, SamplingParams
from llmserve.engine.input_processor import ChatMessage
from llmserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from llmserve.sampling_params import RequestOutputKind, StructuredOutputsParams
from tests.entrypoints.remote_server import RemoteServer
from tests.fixtures.json_schemas import SCHEMAS, validator

MODEL = "smollm2-135m-instruct"
# Room for every schema's requests at once: 60 prompts of up to ~400 tokens plus their answers.
SERVER_ARGS = ["--kv-cache-memory", str(1 << 30), "--max-model-len", "1024", "--disable-log-stats"]
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
# Enough for every schema's answer (the longest valid ones take ~100 tokens); what runs on past it is a
# model echoing keywords into an open object or a number's digits.
JSON_MAX_TOKENS = 160
MAX_CUT = 6  # of the ~60 schemas, per decoding mode (the tests print how many)
# fields of both a request body and SamplingParams
SAMPLED: dict[str, Any] = {"temperature": 0.8, "seed": 7}
GREEDY: dict[str, Any] = {"temperature": 0.0}

ARITHMETIC_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}|0/
"""
ARITHMETIC_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]? [0-9]? | "0"
"""
REGEXES = [
    r"\d{3}-\d{3}-\d{4}",
    r"(yes|no)",
    r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"[a-z]{3,10}@[a-z]{3,8}\.(com|org)",
]


def ask_for(name: str) -> list[ChatMessage]:
    """A short request: the grammar, not the prompt, must bring the schema's structure."""
    return [{"role": "user", "content": f"Give me a {name} as JSON."}]


def check_json(outputs: list[tuple[str, str | None]], label: str) -> None:
    """`outputs[i]` (text, finish_reason) answers SCHEMAS[i]: each that stopped parses and validates."""
    assert len(outputs) == len(SCHEMAS)
    cut = [name for (name, _), (_, finish) in zip(SCHEMAS, outputs) if finish == "length"]
    for (name, schema), (text, finish) in zip(SCHEMAS, outputs):
        if finish == "length":
            continue
        assert finish == "stop", (name, finish, text)
        errors = [e.message for e in validator(schema).iter_errors(json.loads(text))]
        assert not errors, (name, text, errors)
    print(f"{label}: {len(SCHEMAS) - len(cut)} of {len(SCHEMAS)} validated, cut by max_tokens: {cut}")
    assert len(cut) <= MAX_CUT, cut


def is_arithmetic(text: str) -> bool:
    """Whether `text` is a sentence of ARITHMETIC_LARK, by recursive descent (independent of llguidance)."""
    tokens = re.findall(r"[1-9][0-9]{0,2}|0|.", text, re.DOTALL)
    pos = 0

    def take(*options: str) -> bool:
        nonlocal pos
        if pos < len(tokens) and tokens[pos] in options:
            pos += 1
            return True
        return False

    def expr() -> bool:
        if not term():
            return False
        while take("+", "-"):
            if not term():
                return False
        return True

    def term() -> bool:
        if not factor():
            return False
        while take("*", "/"):
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if pos < len(tokens) and tokens[pos].isdigit():
            pos += 1
            return True
        return take("(") and expr() and take(")")

    return expr() and pos == len(tokens)


def test_the_arithmetic_reference_parser() -> None:
    for good in ["1", "0", "12+3*(4-5)/678", "((1))", "1+2+3"]:
        assert is_arithmetic(good), good
    for bad in ["", "01", "1234", "1+", "(1", "1)", "-1", "1 + 2", "1**2", "a"]:
        assert not is_arithmetic(bad), bad


# --- the request fields, mapped without a model -------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
            StructuredOutputsParams(json=PERSON),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "description": "d", "schema": PERSON, "strict": True},
                },
                "structured_outputs": {"whitespace_pattern": " ?", "disable_additional_properties": False},
            },
            StructuredOutputsParams(
                json=PERSON, whitespace_pattern=" ?", disable_additional_properties=False
            ),
        ),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=["a", "b"])),
        (
            {"structured_outputs": {"json": '{"type": "integer"}'}},
            StructuredOutputsParams(json='{"type": "integer"}'),
        ),
        (
            {"structured_outputs": {"grammar": ARITHMETIC_LARK}},
            StructuredOutputsParams(grammar=ARITHMETIC_LARK),
        ),
    ],
)
def test_response_format_and_structured_outputs_become_sampling_params(
    fields: dict[str, Any], expected: StructuredOutputsParams | None
) -> None:
    for request in (
        ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields}),
        CompletionRequest(prompt="x", **fields),
    ):
        params = request.sampling_params(8, None, RequestOutputKind.FINAL_ONLY)
        assert params.structured_outputs == expected


# --- through the server -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def so_server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer(SERVER_ARGS)
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def http(so_server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=so_server.url, timeout=300) as client:
        yield client


async def post_all(url: str, requests: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every (path, body) at once; each answer's first choice."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        responses = await asyncio.gather(*(client.post(path, json=body) for path, body in requests))
    for response in responses:
        assert response.status_code == 200, response.text
    return [response.json()["choices"][0] for response in responses]


def content(choice: dict[str, Any]) -> str:
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_every_json_schema_output_validates_through_the_server(so_server: RemoteServer, mode: str) -> None:
    """Greedy through `response_format`, sampled through `structured_outputs.json`: all at once."""
    sampling = GREEDY if mode == "greedy" else SAMPLED
    bodies = []
    for name, schema in SCHEMAS:
        constraint: dict[str, Any] = (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
            if mode == "greedy"
            else {"structured_outputs": {"json": schema}}
        )
        bodies.append(
            (
                CHAT,
                {"messages": ask_for(name), "max_tokens": JSON_MAX_TOKENS, **sampling, **constraint},
            )
        )
    choices = asyncio.run(post_all(so_server.url, bodies))
    check_json([(content(c), c["finish_reason"]) for c in choices], f"server, {mode}")


def test_every_json_schema_output_validates_offline() -> None:
    """Greedy and sampled in one `LLM.chat` batch."""
    prompts = [ask_for(name) for name, _ in SCHEMAS] * 2
    params = [
        SamplingParams(
            max_tokens=JSON_MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=schema), **mode
        )
        for mode in (GREEDY, SAMPLED)
        for _, schema in SCHEMAS
    ]
    with LLM(MODEL, kv_cache_memory=1 << 30, max_model_len=1024) as llm:
        outputs = [o.outputs[0] for o in llm.chat(prompts, params, use_tqdm=False)]
    pairs = [(o.text, o.finish_reason) for o in outputs]
    check_json(pairs[: len(SCHEMAS)], "offline, greedy")
    check_json(pairs[len(SCHEMAS) :], "offline, sampled")


def test_regex_and_choice_outputs_always_match(so_server: RemoteServer) -> None:
    prompts = [
        "My phone number is",
        "Is the sky blue? Answer:",
        "Her full name is",
        "Today's date is",
        "Email:",
    ]
    requests: list[tuple[str, dict[str, Any]]] = []
    for regex, prompt in zip(REGEXES, prompts):
        for sampling in (GREEDY, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}):
            body = {"prompt": prompt, "max_tokens": 40, "structured_outputs": {"regex": regex}, **sampling}
            requests.append((CMPL, body))
    choices = ["positive", "negative", "neutral", "it's complicated"]
    question = [{"role": "user", "content": "Classify the sentiment: 'I love this library!'"}]
    for seed in range(6):
        body = {"messages": question, "max_tokens": 10, "temperature": 1.0, "seed": seed}
        requests.append((CHAT, {**body, "structured_outputs": {"choice": choices}}))
    answers = asyncio.run(post_all(so_server.url, requests))
    for (_, body), answer in zip(requests, answers):
        assert answer["finish_reason"] == "stop", answer
        if "choice" in body["structured_outputs"]:
            assert content(answer) in choices, answer
        else:
            assert re.fullmatch(body["structured_outputs"]["regex"], content(answer)), (body, answer)


@pytest.mark.parametrize("grammar", [ARITHMETIC_LARK, ARITHMETIC_GBNF], ids=["lark", "gbnf"])
def test_a_grammar_gives_only_its_sentences(so_server: RemoteServer, grammar: str) -> None:
    question = [{"role": "user", "content": "Write an arithmetic expression that equals 42."}]
    requests = [
        (
            CHAT,
            {"messages": question, "max_tokens": 40, "structured_outputs": {"grammar": grammar}, **sampling},
        )
        for sampling in [GREEDY, *({"temperature": 1.0, "seed": seed} for seed in range(7))]
    ]
    answers = asyncio.run(post_all(so_server.url, requests))
    stopped = [content(a) for a in answers if a["finish_reason"] == "stop"]
    assert len(stopped) >= len(answers) - 2, answers
    for text in stopped:
        assert is_arithmetic(text), text


def test_free_requests_beside_constrained_ones_get_the_tokens_they_get_alone(so_server: RemoteServer) -> None:
    free = [
        (CMPL, {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, **sampling})
        for prompt in ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
        for sampling in (GREEDY, SAMPLED)
    ]
    constrained = [
        (CHAT, {"messages": ask_for(name), "max_tokens": 48, "structured_outputs": {"json": schema}})
        for name, schema in SCHEMAS[:10]
    ]
    alone = asyncio.run(post_all(so_server.url, free))
    together = asyncio.run(post_all(so_server.url, constrained + free))[len(constrained) :]
    assert [c["text"] for c in together] == [c["text"] for c in alone]


def test_json_is_compact_by_default(http: httpx.Client) -> None:
    """No whitespace outside strings (a small model given free whitespace can emit newlines until
    max_tokens), on both endpoints."""
    bodies: list[tuple[str, dict[str, object]]] = [
        (CHAT, {"messages": [{"role": "user", "content": "Describe a cat as JSON."}]}),
        (CMPL, {"prompt": "A cat, described in JSON:\n"}),
    ]
    for path, body in bodies:
        request = {**body, "max_tokens": 100, "temperature": 0.0, "response_format": {"type": "json_object"}}
        response = http.post(path, json=request)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        text = content(choice)
        assert isinstance(json.loads(text), dict)
        assert not re.search(r"\s", re.sub(r'"(\\.|[^"\\])*"', "", text)), text


def test_broken_constraints_get_a_400_naming_the_field_and_the_server_keeps_serving(
    http: httpx.Client,
) -> None:
    def schema_format(schema: Any) -> dict[str, Any]:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}

    cases: list[tuple[dict[str, Any], str, str]] = [
        (schema_format({"type": "objekt"}), "response_format.json_schema.schema", "objekt"),
        (
            schema_format({"type": "array", "uniqueItems": True}),
            "response_format.json_schema.schema",
            "uniqueItems",
        ),
        (schema_format({"$ref": "#/$defs/missing"}), "response_format.json_schema.schema", "missing"),
        (
            schema_format({"type": "integer", "minimum": 5, "maximum": 2}),
            "response_format.json_schema.schema",
            "minimum",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "JSON"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed character class"),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
        (
            {"structured_outputs": {"json_object": True, "whitespace_pattern": "[ "}},
            "structured_outputs.whitespace_pattern",
            "unclosed character class",
        ),
        ({"structured_outputs": {"grammar": "???"}}, "structured_outputs.grammar", "Lark"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice", "non-empty"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"structural_tag": "x"}},
            "structured_outputs.structural_tag",
            "structural_tag",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
            "only one",
        ),
        ({"guided_json": PERSON}, "guided_json", "structured_outputs.json"),
        ({"guided_regex": "a+"}, "guided_regex", "structured_outputs.regex"),
        ({"guided_choice": ["a"]}, "guided_choice", "structured_outputs.choice"),
        ({"guided_grammar": ARITHMETIC_LARK}, "guided_grammar", "structured_outputs.grammar"),
        (
            {"guided_whitespace_pattern": " "},
            "guided_whitespace_pattern",
            "structured_outputs.whitespace_pattern",
        ),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "backend"),
    ]
    for fields, param, words in cases:
        for path, body in ((CHAT, {"messages": MESSAGES}), (CMPL, {"prompt": "x"})):
            for stream in (False, True):  # a stream is refused before its 200
                response = http.post(path, json={**body, **fields, "max_tokens": 4, "stream": stream})
                assert response.status_code == 400, (fields, response.text)
                error = response.json()["error"]
                assert error["param"] == param and words in error["message"], (fields, error)
    ok = http.post(
        CHAT, json={"messages": MESSAGES, "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("yes", "no"), ok.text
    assert http.get("/health").status_code == 200


def test_a_constraint_failing_in_the_engine_is_a_400_and_the_server_keeps_serving(http: httpx.Client) -> None:
    """A regex that passes the front end's check, as llguidance compiles lazily, but whose lexer outgrows
    llguidance's limits at the first token: the request fails alone, as the client's error."""
    body = {"prompt": "a", "max_tokens": 8, "structured_outputs": {"regex": "a{99999999}"}}
    response = http.post(CMPL, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs" and "failed during generation" in error["message"], error
    with http.stream("POST", CMPL, json={**body, "stream": True}) as stream:
        assert stream.status_code == 200  # the error comes after the response started, as an event
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "invalid_request_error", events
    ok = http.post(CMPL, json={**body, "structured_outputs": {"regex": "a{3}"}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "aaa", ok.text


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)


def test_the_openai_client_response_format_and_extra_body(so_server: RemoteServer) -> None:
    client = openai.OpenAI(base_url=f"{so_server.url}/v1", api_key="unused", timeout=120)
    question: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Describe a person as JSON."}]
    fmt: ResponseFormatJSONSchema = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    reply = client.chat.completions.create(model=MODEL, messages=question, max_tokens=60, response_format=fmt)
    assert reply.choices[0].finish_reason == "stop", reply
    assert not list(validator(PERSON).iter_errors(json.loads(reply.choices[0].message.content or "")))

    parsed = client.chat.completions.parse(
        model=MODEL, messages=question, max_tokens=60, response_format=Person
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)

    stream = client.chat.completions.create(
        model=MODEL, messages=question, max_tokens=60, response_format=fmt, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert not list(validator(PERSON).iter_errors(json.loads(streamed)))

    choice = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].message.content in ("yes", "no")
    completion = client.completions.create(
        model=MODEL,
        prompt="Call me at",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": REGEXES[0]}},
    )
    assert re.fullmatch(REGEXES[0], completion.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="structured_outputs.json"):
        client.chat.completions.create(model=MODEL, messages=question, extra_body={"guided_json": PERSON})
