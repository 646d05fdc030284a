"""`llmserve chat` and `llmserve complete`: terminal clients of a running OpenAI-compatible server, with
the flags of vLLM's `vllm chat` and `vllm complete`. Answers are printed piece by piece as they stream
in; `-q` sends one message and exits, for scripts."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx

DEFAULT_URL = "http://localhost:8000/v1"
API_KEY_ENV = "OPENAI_API_KEY"
# Generating can take minutes on a CPU: only connecting has a deadline.
TIMEOUT = httpx.Timeout(None, connect=10.0)


class ServerError(Exception):
    """The server refused or failed a request; the message is the server's."""


def _error_message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code} {response.reason_phrase}: {response.text[:200]}"


class Client:
    """One server: its `/v1` base URL, the key it wants, and the model asked for (by default, the first
    it lists)."""

    def __init__(self, url: str, api_key: str | None, model: str | None) -> None:
        self.url = url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT)
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        response = self.http.get("models")
        if response.is_error:
            raise ServerError(_error_message(response))
        return str(response.json()["data"][0]["id"])

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[str]:
        """The text pieces of a streamed (chat) completion as they arrive. Closing the iterator early
        closes the connection, which aborts the request on the server."""
        with self.http.stream("POST", path, json={"model": self.model, **body, "stream": True}) as response:
            if response.is_error:
                response.read()
                raise ServerError(_error_message(response))
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    raise ServerError(chunk["error"]["message"])
                for choice in chunk["choices"]:
                    piece = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                    if piece:
                        yield piece


def print_streamed(pieces: Iterator[str]) -> str:
    """Print each piece the moment it arrives (flushed, so a pipe sees it too); return the whole text."""
    text = []
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        text.append(piece)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(text)


def _lines(prompt: str) -> Iterator[str]:
    """Non-empty lines typed at `prompt`, until end of input."""
    while True:
        try:
            line = input(prompt)
        except EOFError:
            print()
            return
        if line.strip():
            yield line


def _sampling(ns: argparse.Namespace) -> dict[str, Any]:
    fields = {"max_tokens": ns.max_tokens, "temperature": ns.temperature}
    return {name: value for name, value in fields.items() if value is not None}


def _chat(ns: argparse.Namespace, client: Client) -> None:
    history = [{"role": "system", "content": ns.system_prompt}] if ns.system_prompt else []
    for message in [ns.quick] if ns.quick is not None else _lines("> "):
        history.append({"role": "user", "content": message})
        answer = print_streamed(client.stream("chat/completions", {"messages": history, **_sampling(ns)}))
        history.append({"role": "assistant", "content": answer})


def _complete(ns: argparse.Namespace, client: Client) -> None:
    for prompt in [ns.quick] if ns.quick is not None else _lines("> "):
        print_streamed(client.stream("completions", {"prompt": prompt, **_sampling(ns)}))


def _run(command: Callable[[argparse.Namespace, Client], None]) -> Callable[[argparse.Namespace], None]:
    def run(ns: argparse.Namespace) -> None:
        try:
            client = Client(ns.url, ns.api_key or os.environ.get(API_KEY_ENV), ns.model)
            if ns.quick is None:
                print(f"{client.model} at {client.url}; end with Ctrl-D.", file=sys.stderr)
            command(ns, client)
        except ServerError as e:
            sys.exit(f"error: {e}")
        except httpx.TransportError as e:
            sys.exit(f"error: cannot reach {ns.url}: {e}")
        except KeyboardInterrupt:
            sys.exit(130)

    return run


def add_client_commands(commands: argparse._SubParsersAction) -> None:
    """`chat` and `complete` under the `llmserve` command."""
    for name, command, summary in (
        ("chat", _chat, "Chat with a running server's model in the terminal."),
        ("complete", _complete, "Complete prompts with a running server's model in the terminal."),
    ):
        parser = commands.add_parser(name, help=summary)
        parser.add_argument("--url", default=DEFAULT_URL, help=f"the server's API (default: {DEFAULT_URL})")
        parser.add_argument(
            "--api-key", default=None, help=f"sent as 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})"
        )
        parser.add_argument(
            "--model", "--model-name", dest="model", default=None, help="(default: the first of /v1/models)"
        )
        parser.add_argument("--max-tokens", type=int, default=None, help="(default: the server's)")
        parser.add_argument("--temperature", type=float, default=None, help="(default: the server's)")
        parser.add_argument(
            "-q", "--quick", metavar="TEXT", default=None, help="send TEXT alone, print the answer and exit"
        )
        if name == "chat":
            parser.add_argument("--system-prompt", default=None, help="the conversation's system message")
        parser.set_defaults(func=_run(command))
