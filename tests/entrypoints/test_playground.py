"""The web playground at `/`, driven in a real headless Chromium (Debian's `chromium`, through Playwright's
Python API) against a real server that wants an API key: the page asks for the key, streams a chat,
keeps its history, stops a generation on the server, regenerates, completes, and shows model output
as text."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from playwright.sync_api import Browser, Dialog, Page, Request, sync_playwright

from tests.entrypoints.conftest import MODEL, SERVER_ARGS
from tests.entrypoints.remote_server import RemoteServer

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
API_KEY = "playground-test-key"
# The README shows it: the chat after a rendered code answer and a regenerated one. Written there only
# with LLMSERVE_UPDATE_SCREENSHOT=1 (its figures differ every run); always under the test's tmp path.
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "playground.png"
SYSTEM_PROMPT = "You are a concise assistant."
FIRST_PROMPT = "Write a Python function that adds two numbers."  # its answer has a code block
STATS = re.compile(r"^TTFT \d+ ms · [\d.]+ tok/s · \d+ prompt tokens · \d+ output tokens · ")
# A long answer at temperature 0 (the default model does not end it early), for Stop to cut short.
LONG_PROMPT = "Write a very long story about a dragon and a knight."
LONG_MAX_TOKENS = 700  # with its history, within the server's max_model_len


@pytest.fixture(scope="module")
def server(default_model_path: object) -> Iterator[RemoteServer]:
    remote = RemoteServer([*SERVER_ARGS, "--api-key", API_KEY])
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium package.")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    match = re.search(rf"^llmserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"no {name} in /metrics"
    return float(match.group(1))


def set_fields(page: Page, **values: str) -> None:
    for field, value in values.items():
        page.fill(f"#{field}", value)


def watch_stream(page: Page, answer: str) -> list[int]:
    """The lengths of `answer`'s text seen while the page streams (its Stop enabled), until it ends."""
    lengths = []
    while page.is_enabled("#stop-chat") or page.is_enabled("#stop-complete"):
        lengths.append(len(page.inner_text(answer)))
        time.sleep(0.02)
    return lengths


def wait_growing(page: Page, answer: str) -> list[int]:
    """Wait until `answer`'s text has grown over two observations after its first text, while the page
    streams."""
    seen: list[int] = []
    deadline = time.monotonic() + 30
    while (
        len({n for n in seen if n > 0}) < 3 and page.is_enabled("#stop-chat") and time.monotonic() < deadline
    ):
        seen.append(len(page.inner_text(answer)))
        time.sleep(0.02)
    return seen


def assert_streamed(lengths: list[int]) -> None:
    """Text appeared piece by piece: it grew between two observations. (Rendered Markdown may shrink a
    little, as when a closing `**` turns text bold.)"""
    nonempty = [n for n in lengths if n > 0]
    assert nonempty and nonempty[0] < max(nonempty), (
        f"the answer did not grow while streaming: {lengths[-20:]}"
    )


def wait_model(page: Page) -> None:
    page.wait_for_function(f"() => document.getElementById('model').textContent === {json.dumps(MODEL)}")


def enter_key(page: Page) -> None:
    """The model list answers 401 without a key: the page asks once, keeps the key, and retries."""
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", API_KEY)
    page.click("#key-save")
    wait_model(page)
    assert page.evaluate("localStorage.getItem('llmserve.apiKey')") == API_KEY
    page.reload()  # the stored key is used without asking again
    wait_model(page)
    assert not page.is_visible("#key-dialog")


def chat(page: Page) -> str:
    """A streamed answer with a rendered code block, its figures, and Copy; returns the answer."""
    set_fields(page, **{"system-prompt": SYSTEM_PROMPT, "temperature": "0", "max_tokens": "120"})
    page.fill("#chat-input", FIRST_PROMPT)
    page.click("#send")
    first = ".message.assistant >> nth=0"
    assert_streamed(watch_stream(page, f"{first} >> .content"))
    assert page.locator(f"{first} >> pre code").count() >= 1
    assert STATS.match(page.inner_text(f"{first} >> .stats")), page.inner_text(f"{first} >> .stats")
    answer = str(page.evaluate("state.messages[1].content"))
    page.click(f"{first} >> text=Copy")
    assert page.evaluate("navigator.clipboard.readText()") == answer
    return answer


def posted_json(request: Request) -> dict[str, Any]:
    """The JSON body the page posted (Playwright's type allows none: the page's API calls all have one)."""
    return cast(dict[str, Any], request.post_data_json)


def stop_midway(page: Page, server: RemoteServer, history: list[dict[str, str]]) -> None:
    """A long answer sent with the history and the key; Stop ends it on the server: the running gauge
    returns to 0 well before its max_tokens were generated."""
    set_fields(page, max_tokens=str(LONG_MAX_TOKENS))
    generated_before = metric(server, "generation_tokens_total")
    page.fill("#chat-input", LONG_PROMPT)
    with page.expect_request("**/v1/chat/completions") as request:
        page.click("#send")
    assert request.value.headers["authorization"] == f"Bearer {API_KEY}"
    assert posted_json(request.value)["messages"] == history
    second = ".message.assistant >> nth=1"
    assert_streamed(wait_growing(page, f"{second} >> .content"))
    assert metric(server, "num_requests_running") == 1
    page.click("#stop-chat")
    deadline = time.monotonic() + 10
    while metric(server, "num_requests_running") != 0:
        assert time.monotonic() < deadline, "the stopped request still runs on the server"
        time.sleep(0.1)
    assert metric(server, "generation_tokens_total") - generated_before < LONG_MAX_TOKENS
    assert page.inner_text(f"{second} >> .stats").endswith("stopped")


def regenerate(page: Page, history: list[dict[str, str]]) -> None:
    """Regenerate answers the last question again, without the stopped answer in the history."""
    set_fields(page, max_tokens="24")
    with page.expect_request("**/v1/chat/completions") as request:
        page.click(".message.assistant >> nth=1 >> .regenerate")
    assert posted_json(request.value)["messages"] == history
    page.wait_for_function("() => state.controller === null && state.messages.length === 4")
    assert page.locator(".message.assistant").count() == 2
    assert STATS.match(page.inner_text(".message.assistant >> nth=1 >> .stats"))


def complete(page: Page, server: RemoteServer) -> None:
    """The completions tab streams the API's greedy answer."""
    page.click("#tab-complete")
    assert page.is_hidden("#system-prompt")
    set_fields(page, prompt="The capital of France is", max_tokens="16")
    page.click("#run")
    assert_streamed(watch_stream(page, "#completion .output-text"))
    expected = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "top_p": 1},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ).json()["choices"][0]["text"]
    assert page.inner_text("#completion .output-text") == expected
    assert STATS.match(page.inner_text("#completion-stats"))


def structured(page: Page) -> None:
    """The JSON-schema box: a broken schema is refused in the page; a schema goes as response_format."""
    page.fill("#json-schema", "{")
    page.click("#run")
    assert "not JSON" in page.inner_text("#completion .output-text")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    set_fields(page, **{"json-schema": json.dumps(schema), "max_tokens": "12"})
    with page.expect_request("**/v1/completions") as request:
        page.click("#run")
    response_format = {"type": "json_schema", "json_schema": {"name": "playground", "schema": schema}}
    assert posted_json(request.value)["response_format"] == response_format
    page.wait_for_function("() => state.controller === null")
    assert re.match(r'\{\s*"city"', page.inner_text("#completion .output-text"))


def test_chat_stop_regenerate_and_complete(browser: Browser, server: RemoteServer, tmp_path: Path) -> None:
    context = browser.new_context(
        viewport={"width": 1280, "height": 860}, permissions=["clipboard-read", "clipboard-write"]
    )
    page = context.new_page()
    dialogs: list[str] = []

    def dismiss(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", dismiss)
    page.goto(f"{server.url}/")
    enter_key(page)
    history = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": FIRST_PROMPT}]
    history += [{"role": "assistant", "content": chat(page)}, {"role": "user", "content": LONG_PROMPT}]
    stop_midway(page, server, history)
    regenerate(page, history)
    page.screenshot(path=str(tmp_path / "chat.png"))
    if os.environ.get("LLMSERVE_UPDATE_SCREENSHOT") == "1":
        page.screenshot(path=str(SCREENSHOT))
    complete(page, server)
    page.screenshot(path=str(tmp_path / "completions.png"))
    structured(page)
    assert dialogs == []
    context.close()


HOSTILE_PIECES = [
    "Look: <scr",
    'ipt>window.__pwned = 1</script> and <img src=x onerror="alert(1)">',
    "\n\n**bold** [link](javascript:alert(1))\n\n```html\n<b>x</b>\n```",
]


def sse(pieces: list[str]) -> str:
    chunks: list[dict[str, object]] = [
        {"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in pieces
    ]
    chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"


def test_model_output_is_shown_as_text(browser: Browser, server: RemoteServer) -> None:
    context = browser.new_context()
    context.add_init_script(f"localStorage.setItem('llmserve.apiKey', {json.dumps(API_KEY)})")
    page = context.new_page()
    dialogs: list[str] = []

    def dismiss(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", dismiss)
    # The page's own streaming and rendering path, fed an answer a model could give.
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=sse(HOSTILE_PIECES)),
    )
    page.goto(f"{server.url}/")
    wait_model(page)
    page.fill("#chat-input", "Say something dangerous.")
    page.click("#send")
    page.wait_for_function("() => state.controller === null && state.messages.length === 2")

    answer = page.locator(".message.assistant .content")
    text = answer.inner_text()
    assert '<script>window.__pwned = 1</script> and <img src=x onerror="alert(1)">' in text
    assert answer.locator("script, img, b, a").count() == 0
    assert answer.locator("strong").inner_text() == "bold"
    assert answer.locator("pre code").inner_text() == "<b>x</b>"
    assert page.evaluate("window.__pwned") is None
    assert dialogs == []

    # The renderer alone: markup only from Markdown, every attribute value escaped.
    render = "(text) => renderMarkdown(text)"
    assert (
        page.evaluate(render, "<img src=x onerror=alert(1)>") == "<p>&lt;img src=x onerror=alert(1)&gt;</p>"
    )
    assert page.evaluate(render, '[a](https://x.org/"onmouseover="f()) [b](https://x.org/"onclick="g)') == (
        '<p>[a](https://x.org/&quot;onmouseover=&quot;f()) <a href="https://x.org/&quot;onclick=&quot;g" '
        'target="_blank" rel="noopener noreferrer">b</a></p>'
    )
    assert page.evaluate(render, "# T `<i>` *e*\n- a\n- b") == (
        "<h1>T <code>&lt;i&gt;</code> <em>e</em></h1><ul><li>a</li><li>b</li></ul>"
    )
    context.close()


@pytest.mark.parametrize("path", ["/", "/playground/app.js", "/playground/style.css"])
def test_every_playground_file_carries_the_security_headers(server: RemoteServer, path: str) -> None:
    response = httpx.get(server.url + path)
    assert response.status_code == 200, path
    assert "default-src 'none'" in response.headers["content-security-policy"]
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"
