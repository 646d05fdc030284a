"""Results files: each benchmark's figures as JSON, with the command and machine that produced them, so
that `benchmarks/report.py` can rebuild the README's table without retyping a number."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from benchmarks.common.machine import describe


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")


# The peers' locations differ between machines: commands name them by variables the reader sets.
PEER_VARIABLES = {
    "--llama-cpp-python": "$LLAMA_CPP_PYTHON",
    "--vllm-python": "$VLLM_PYTHON",
    "--llama-batched-bench": "$LLAMA_CPP_BIN/llama-batched-bench",
    "--llama-server": "$LLAMA_CPP_BIN/llama-server",
    "--st-python": "$ST_PYTHON",
}


def portable_command(argv: list[str]) -> str:
    """A shell command line with each peer's path replaced by its variable (`PEER_VARIABLES`)."""
    words = [shlex.quote(arg) for arg in argv]
    for i, arg in enumerate(argv[:-1]):
        if arg in PEER_VARIABLES:
            words[i + 1] = PEER_VARIABLES[arg]
    return " ".join(words)


def command_line(module: str) -> str:
    """How to rerun this benchmark: its module and arguments, without the --json destination."""
    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip or arg.startswith("--json="):
            skip = False
            continue
        if arg == "--json":
            skip = True
            continue
        args.append(arg)
    return portable_command(["python", "-m", module, *args])


def write_results(path: Path | None, module: str, results: dict[str, Any], foreign_load: float) -> None:
    if path is None:
        return
    document = {
        "benchmark": module.rsplit(".", 1)[-1],
        "command": command_line(module),
        "machine": describe(foreign_load),
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"results written to {path}")
