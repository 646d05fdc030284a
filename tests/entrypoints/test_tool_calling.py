"""Tool calling on /v1/chat/completions: the parsers alone (every way a stream can cut the text), then a
real server on Qwen2.5-Coder-0.5B-Instruct driven by the official `openai` client through whole
conversations (tool call, tool result, final answer) with `auto`, `required` and a named function.

The server reads `auto` calls with `llama3_json`: this model writes its calls as a bare
`{"name": ..., "arguments": ...}` object, never inside the `<tool_call>` tags its template asks for
(`<tool_call>` is not among its five likeliest first tokens), so `hermes` would find none; `hermes` is
tested here on the text Qwen's own template writes for a call."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from llmserve.entrypoints.openai.errors import OpenAIError
from llmserve.entrypoints.openai.protocol import ChatCompletionRequest
from llmserve.entrypoints.openai.server_args import ServerArgs
from llmserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from llmserve.entrypoints.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    required_schema,
)
from llmserve.entrypoints.openai.tool_parsers.tool_calls import ToolCallStream, extract_tool_calls
from llmserve.entrypoints.openai.tool_parsers.tool_parser import ToolParser
from llmserve.entrypoints.openai.tool_use import tool_use
from llmserve.model_executor.loader import load_tokenizer, resolve_model
from tests.entrypoints.remote_server import RemoteServer

MODEL = "qwen2.5-coder-0.5b-instruct"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "the city name"}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
            },
        },
    },
]
QUESTION = {"role": "user", "content": "What is the weather like in Paris today?"}
WEATHER_REPORT = "sunny, 21 degrees Celsius"
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# --- the parsers -------------------------------------------------------------------------------------

HERMES_OUTPUT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", '
    '"days": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
    "\n</tool_call>"
)
HERMES_CALLS = [("get_weather", '{"city": "Paris, \\"FR\\"", "days": [1, {"a": "}"}]}'), ("get_time", "{}")]
LLAMA_OUTPUT = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time"}'
LLAMA_CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def streamed(parser: ToolParser, text: str, size: int, max_calls: int | None = None) -> tuple[str, list[Any]]:
    """Streams `text` in pieces of `size` characters, checks each delta's shape as OpenAI sends it,
    and joins them: (content, [(name, arguments)])."""
    stream = ToolCallStream(parser, max_calls)
    content = ""
    calls: list[list[str]] = []
    chunks = pieces(text, size)
    for i, piece in enumerate(chunks):
        delta = stream.delta(piece, final=i == len(chunks) - 1)
        assert set(delta) <= {"content", "tool_calls"}
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):  # a new call: all of it announced at once
                assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function"
                assert call["id"].startswith("call_") and len(call["id"]) == 29
                calls.append([call["function"]["name"], call["function"]["arguments"]])
            else:  # then only its arguments, appended
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                assert call["function"]["arguments"]
                calls[call["index"]][1] += call["function"]["arguments"]
    assert stream.called == bool(calls)
    return content, [tuple(c) for c in calls]


@pytest.mark.parametrize("size", [1, 2, 5, 13, 10_000])
def test_hermes_parser_stream_equals_whole(size: int) -> None:
    whole = extract_tool_calls(TOOL_PARSERS["hermes"](), HERMES_OUTPUT, None)
    assert whole == ("Let me check. ", HERMES_CALLS)
    assert streamed(TOOL_PARSERS["hermes"](), HERMES_OUTPUT, size) == ("Let me check. ", HERMES_CALLS)
    # parallel_tool_calls false: the first call only
    assert extract_tool_calls(TOOL_PARSERS["hermes"](), HERMES_OUTPUT, 1)[1] == HERMES_CALLS[:1]
    assert streamed(TOOL_PARSERS["hermes"](), HERMES_OUTPUT, size, 1)[1] == HERMES_CALLS[:1]


@pytest.mark.parametrize("size", [1, 7, 10_000])
@pytest.mark.parametrize(
    ("tail", "max_calls"),
    [
        ('<tool_call>\n{"name": "get_weather", "argu', 1),  # a second call cut short, past the one kept
        ("<tool_call>\n", None),  # a last call opened, never begun
    ],
)
def test_hermes_stream_equals_whole_whatever_follows_the_calls(
    size: int, tail: str, max_calls: int | None
) -> None:
    first = HERMES_OUTPUT[: HERMES_OUTPUT.index("</tool_call>") + len("</tool_call>")] + "\n"
    whole = extract_tool_calls(TOOL_PARSERS["hermes"](), first + tail, max_calls)
    assert whole == ("Let me check. ", HERMES_CALLS[:1])
    assert streamed(TOOL_PARSERS["hermes"](), first + tail, size, max_calls) == whole


@pytest.mark.parametrize("size", [1, 3, 10_000])
def test_llama3_json_parser_stream_equals_whole(size: int) -> None:
    assert extract_tool_calls(TOOL_PARSERS["llama3_json"](), LLAMA_OUTPUT, None) == (None, LLAMA_CALLS)
    assert streamed(TOOL_PARSERS["llama3_json"](), LLAMA_OUTPUT, size) == ("", LLAMA_CALLS)
    bare = LLAMA_OUTPUT.removeprefix("<|python_tag|>")
    assert streamed(TOOL_PARSERS["llama3_json"](), "  " + bare, size) == ("", LLAMA_CALLS)
    assert extract_tool_calls(TOOL_PARSERS["llama3_json"](), bare + " ;\n", None) == (None, LLAMA_CALLS)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice(["", "a", 'quote " and \\ back', "brace } ] {", "é ✓", "\n\t"])
    if kind == 1:
        return rng.choice([0, -1, 3.25, 1e-7, 12345678901234567890])
    if kind == 2:
        return rng.choice([True, False])
    if kind == 3:
        return None
    if kind in (4, 5):
        return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_any_json_arguments_stream_and_parse_back() -> None:
    """Random arguments, written compact, spaced or indented, in calls cut at random points."""
    rng = random.Random(0)
    for _ in range(200):
        arguments = {f"p{i}": random_value(rng) for i in range(rng.randrange(1, 4))}
        style: dict[str, Any] = rng.choice(
            [{"separators": (",", ":")}, {}, {"indent": 2}, {"ensure_ascii": False}]
        )
        call = (
            {"name": "f", "arguments": arguments}
            if rng.random() < 0.8
            else {"arguments": arguments, "name": "f"}
        )
        text = f"<tool_call>\n{json.dumps(call, **style)}\n</tool_call>"
        content, calls = extract_tool_calls(TOOL_PARSERS["hermes"](), text, None)
        assert content is None and len(calls) == 1 and json.loads(calls[0][1]) == arguments, text
        assert streamed(TOOL_PARSERS["hermes"](), text, rng.randrange(1, 9)) == ("", calls)


NO_CALL = [
    "The weather is fine.",
    "",
    "A <tool and more <tool_cal",  # could have opened a call, until the end
    '{"answer": 42}',  # JSON, but no call: no name
    '{"name": 3, "arguments": {}}',
    '{"name" "f"}',
]
# broken once the name is out: a stream has announced the call by then (as vLLM's would)
BROKEN_CALL = [
    '<tool_call>\n{"name": "f", "arguments": {"x": }}\n</tool_call>',  # arguments not JSON
    '<tool_call>\n{"name": "f", "arguments": {"x": 1',  # cut by max_tokens
    '{"name": "f", "arguments": {"x": 1',
]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
@pytest.mark.parametrize("text", NO_CALL + BROKEN_CALL)
def test_output_without_a_valid_call_is_content(parser: str, text: str) -> None:
    """As vLLM: a call that does not parse leaves the whole output as content; so does a stream that
    announced no call by then."""
    assert extract_tool_calls(TOOL_PARSERS[parser](), text, None) == (text, [])
    for size in (1, 4, 1000):
        content, calls = streamed(TOOL_PARSERS[parser](), text, size)
        if text in NO_CALL or not calls:
            assert (content, calls) == (text, [])
        else:
            assert calls[0][0] == "f" and calls[0][1] in text


def test_hermes_reads_the_calls_qwens_template_writes(qwen_gguf_path: Path) -> None:
    """A conversation's assistant calls, rendered by Qwen2.5's template, parse back into the same calls."""
    tokenizer = load_tokenizer(resolve_model(MODEL))
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "Europe/Paris"})]
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ],
    }
    conversation: list[Any] = [QUESTION, message]
    text = str(tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False))
    reply = text.rsplit("<|im_start|>assistant", 1)[1].split("<|im_end|>")[0]
    content, found = extract_tool_calls(TOOL_PARSERS["hermes"](), reply, None)
    assert content == "\n" and [(n, json.loads(a)) for n, a in found] == calls


def test_forced_choices_parse_their_schemas_outputs() -> None:
    output = '[{"name":"get_weather","parameters":{"city":"Paris"}},'
    output += '{"name":"get_time","parameters":{"zone":"UTC"}}]'
    expected = [("get_weather", '{"city":"Paris"}'), ("get_time", '{"zone":"UTC"}')]
    for size in (1, 7, 1000):
        assert streamed(RequiredToolParser(), output, size) == ("", expected)
        assert streamed(NamedToolParser("get_weather"), '{"city":"Paris"}', size) == ("", expected[:1])
    assert extract_tool_calls(RequiredToolParser(), output, None) == (None, expected)
    # cut short by max_tokens: no call, the text as content
    assert extract_tool_calls(NamedToolParser("f"), '{"city":"Pa', None) == ('{"city":"Pa', [])


def test_required_schema_admits_exactly_the_calls_of_the_tools() -> None:
    functions = [tool["function"] for tool in TOOLS]
    schema = required_schema(functions, parallel=True)
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "get_time", "parameters": {"zone": "Z"}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"zone": "Z"}}],  # another tool's parameters
        [{"name": "get_weather", "parameters": {"city": "Paris"}, "extra": 1}],
        [{"name": "nope", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate(good, required_schema(functions, parallel=False))
    # $defs move to the root, where the parameters' references point
    point = {
        "$defs": {"P": {"type": "integer"}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/P"}},
    }
    schema = required_schema([{"name": "f", "parameters": point}], parallel=True)
    jsonschema.validate([{"name": "f", "parameters": {"x": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"x": "1"}}], schema)
    assert "$defs" in point  # the request's own schema is left alone
    clash = {"$defs": {"P": {"type": "string"}}, "type": "object"}
    with pytest.raises(ValueError, match=r"\$defs/P"):
        required_schema([{"name": "f", "parameters": point}, {"name": "g", "parameters": clash}], True)


@pytest.mark.parametrize(
    "body, auto_parser, message",
    [
        ({"tools": TOOLS}, None, "--enable-auto-tool-choice"),  # auto is the default with tools
        ({"tools": TOOLS, "tool_choice": "auto"}, None, "--enable-auto-tool-choice"),
        ({"tool_choice": "required"}, "hermes", "`tools` must be set"),
        ({"tool_choice": NAMED}, "hermes", "`tools` must be set"),
        ({"tools": [], "tool_choice": NAMED}, "hermes", "does not match"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            None,
            "does not match",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, None, "distinct"),
    ],
)
def test_tool_choice_refusals(body: dict[str, Any], auto_parser: str | None, message: str) -> None:
    request = ChatCompletionRequest.model_validate({"messages": [QUESTION], **body})
    with pytest.raises(OpenAIError, match=message) as refused:
        tool_use(request, auto_parser)
    assert refused.value.status == 400 and refused.value.param in ("tool_choice", "tools")


def test_tool_choice_without_calls() -> None:
    def use(body: dict[str, Any], auto_parser: str | None = None) -> Any:
        return tool_use(ChatCompletionRequest.model_validate({"messages": [QUESTION], **body}), auto_parser)

    none = use({"tools": TOOLS, "tool_choice": "none"})
    assert none.parser is None and none.schema is None and none.tools == TOOLS  # the template still sees them
    bodies: list[dict[str, Any]] = [
        {},
        {"tools": []},
        {"tool_choice": "auto"},
        {"tools": [], "tool_choice": "required"},
    ]
    for body in bodies:
        assert use(body).parser is None and use(body).tools is None
    assert use({"tools": TOOLS, "parallel_tool_calls": False, "tool_choice": "required"}).max_calls == 1
    named = use({"tools": TOOLS, "tool_choice": NAMED})
    assert named.schema == WEATHER_PARAMETERS


def test_server_flags() -> None:
    """vLLM's rules: auto tool choice needs a parser, and the parser must be one we have."""
    assert ServerArgs(tool_call_parser="hermes").auto_tool_parser is None
    assert ServerArgs(tool_call_parser="hermes", enable_auto_tool_choice=True).auto_tool_parser == "hermes"
    with pytest.raises(ValueError, match="requires tool_call_parser"):
        ServerArgs(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerArgs(tool_call_parser="pythonic")


# --- a real server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(qwen_gguf_path: Path) -> Iterator[RemoteServer]:
    remote = RemoteServer(
        [MODEL, "--kv-cache-memory", str(256 << 20), "--max-model-len", "2048", "--disable-log-stats"]
        + ["--tool-call-parser", "llama3_json", "--enable-auto-tool-choice"]
    )
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def ask(client: openai.OpenAI, stream: bool, **args: Any) -> tuple[str | None, list[dict[str, Any]], str]:
    """One chat completion, greedy: (content, tool calls as dicts, finish reason), streamed or not."""
    args = {"model": MODEL, "tools": TOOLS, "temperature": 0.0, "max_tokens": 40, **args}
    if not stream:
        whole = client.chat.completions.create(**args).choices[0]
        made = [call.model_dump(exclude_none=True) for call in whole.message.tool_calls or []]
        return whole.message.content, made, whole.finish_reason
    content: str | None = None
    calls: list[dict[str, Any]] = []
    finish: str | None = None
    for chunk in client.chat.completions.create(**args, stream=True):
        (choice,) = chunk.choices
        content = (content or "") + choice.delta.content if choice.delta.content else content
        for call in choice.delta.tool_calls or []:
            function = call.function
            assert function is not None
            if call.index == len(calls):  # announced: index, id, type, name, arguments so far
                assert (
                    call.id and call.type == "function" and function.name and function.arguments is not None
                )
                calls.append({"id": call.id, "type": "function", "function": function.model_dump()})
            else:
                assert call.id is None and function.name is None and function.arguments
                calls[call.index]["function"]["arguments"] += function.arguments
        finish = choice.finish_reason or finish
    assert finish is not None
    return content, calls, finish


def conversation(client: openai.OpenAI, tool_choice: Any, stream: bool) -> str:
    """Turn one forced or left to the model; turn two answers from the tool's result: its answer."""
    content, calls, finish = ask(client, stream, messages=[QUESTION], tool_choice=tool_choice)
    named = isinstance(tool_choice, dict)  # OpenAI and vLLM answer `stop` for a named function
    assert finish == ("stop" if named else "tool_calls") and not content, (content, calls)
    (call,) = calls
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_PARAMETERS)
    messages = [
        QUESTION,
        {"role": "assistant", "content": content, "tool_calls": calls},
        {"role": "tool", "tool_call_id": call["id"], "content": WEATHER_REPORT},
        {"role": "user", "content": "Answer in one sentence."},
    ]
    answer, more_calls, finish = ask(client, stream, messages=messages, tool_choice="auto")
    assert finish == "stop" and not more_calls and answer
    return answer


def test_two_turn_conversations(client: openai.OpenAI) -> None:
    """auto, required and a named function, each streamed and not, all at once (one batch)."""
    cases = [(choice, stream) for choice in ("auto", "required", NAMED) for stream in (False, True)]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: conversation(client, *case), cases))
    assert all("21" in answer for answer in answers), answers  # the tool's result reached the model


def test_none_and_the_openai_clients_round_trip(client: openai.OpenAI) -> None:
    """`none` answers in text, with the tools in the prompt; an assistant message as the client returns
    it (the response's own object) is accepted back."""
    content, calls, finish = ask(client, False, messages=[QUESTION], tool_choice="none", max_tokens=4)
    assert content and not calls and finish == "length"
    args: dict[str, Any] = {"model": MODEL, "tools": TOOLS, "temperature": 0.0, "max_tokens": 30}
    args |= {"messages": [QUESTION], "tool_choice": "required"}
    message = client.chat.completions.create(**args).choices[0].message
    assert message.tool_calls
    answer = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": WEATHER_REPORT}
    args |= {"messages": [QUESTION, message, answer], "tool_choice": "none", "max_tokens": 1}
    reply = client.chat.completions.create(**args)
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
                "tool_choice": "required",
            },
            "tools",
        ),  # fmt: skip
        ({"messages": [QUESTION, {"role": "assistant", "content": None}]}, "messages[1].content"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]},
            "messages[0].tool_call_id",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}
                ]
            },
            "messages[0].tool_calls[0].function",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    server: RemoteServer, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": [QUESTION], "max_tokens": 1, **body}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
