"""Command-line flags generated from an options dataclass (`EngineArgs`, `ServerArgs`), so that each
option is declared once: its field's name, type and default make the flag, and its metadata
(`config.option()`) its help and, where vLLM spells the flag otherwise, that spelling."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Collection
from typing import Any


def add_flags(parser: argparse.ArgumentParser, options: type, skip: Collection[str] = ()) -> None:
    """One flag per field of `options` but those in `skip`: a boolean as `--x/--no-x`, a tuple as one or
    more values, a `Literal` as its choices."""
    hints = typing.get_type_hints(options)
    for f in dataclasses.fields(options):
        if f.name in skip:
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        help_text = " ".join(filter(None, [f.metadata.get("help"), _default_note(f.default)]))
        if hint is bool:
            action = argparse.BooleanOptionalAction
            parser.add_argument(flag, dest=f.name, action=action, default=f.default, help=help_text)
            continue
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        literal = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
        choices = literal or f.metadata.get("choices")
        kind = int if int in args or hint is int else float if float in args or hint is float else str
        parser.add_argument(
            flag,
            dest=f.name,
            type=kind,
            nargs="+" if typing.get_origin(hint) is tuple else None,
            metavar=None if choices else flag.removeprefix("--").replace("-", "_").upper(),
            default=None if f.metadata.get("env") else f.default,
            choices=sorted(choices) if choices else None,
            help=help_text,
        )


def values_from(ns: argparse.Namespace, options: type) -> dict[str, Any]:
    """The fields of `options` that `ns` holds (its flags' values), ready for its constructor."""
    values = {}
    for f in dataclasses.fields(options):
        if not hasattr(ns, f.name):
            continue
        value = getattr(ns, f.name)
        if value is None and (env := f.metadata.get("env")):
            value = os.environ.get(env) or None
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def _default_note(default: Any) -> str:
    if default is None or default is False or default == () or default is dataclasses.MISSING:
        return ""
    return f"(default: {default:g})" if isinstance(default, float) else f"(default: {default})"
