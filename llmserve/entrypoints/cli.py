"""The `llmserve` command. Engine flags are generated from `EngineArgs`, so one name means one thing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from llmserve.config import EngineArgs
from llmserve.entrypoints.chat_client import add_client_commands
from llmserve.entrypoints.flags import add_flags, values_from
from llmserve.entrypoints.openai.server_args import add_server_args, server_args_from


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, EngineArgs, skip={"model"})  # a positional argument or --model, by command


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**values_from(ns, EngineArgs))


def _generate(ns: argparse.Namespace) -> None:
    from llmserve import LLM, SamplingParams

    llm = LLM(**vars(engine_args_from(ns)))
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.sampling_seed)
    if ns.chat:
        output = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False)[0]
    else:
        output = llm.generate(ns.prompt, params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    llm.shutdown()


def _serve(ns: argparse.Namespace) -> None:
    from llmserve.entrypoints.openai.api_server import run_server

    run_server(engine_args_from(ns), server_args_from(ns))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description="Run and serve language models.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="Print the completion of one prompt.")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=EngineArgs.model, help="GGUF file, HF folder or packaged name")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    serve = commands.add_parser("serve", help="Start the OpenAI-compatible HTTP server.")
    serve.add_argument(
        "model", nargs="?", default=EngineArgs.model, help="GGUF file, HF folder or packaged name"
    )
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=_serve)
    add_client_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    try:
        ns.func(ns)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
