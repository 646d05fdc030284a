"""Each option is declared once: `llmserve serve`'s flags come from `ServerArgs` and `EngineArgs`, and
`EngineArgs` restates the engine's sub-configs field for field, with their defaults and help."""

from __future__ import annotations

import dataclasses

import pytest

from llmserve.config import (
    CacheConfig,
    EngineArgs,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from llmserve.entrypoints.cli import build_parser, engine_args_from
from llmserve.entrypoints.openai.server_args import ServerArgs, server_args_from

SUB_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, StructuredOutputsConfig)
# EngineArgs' own: the speculative config's JSON (parsed into SpeculativeConfig) and where the core runs
NOT_IN_A_SUB_CONFIG = {"speculative_config", "multiprocess"}


def test_engine_args_restate_every_sub_config_field_with_its_default() -> None:
    args = {f.name: f for f in dataclasses.fields(EngineArgs)}
    seen: set[str] = set()
    for config in SUB_CONFIGS:
        for f in dataclasses.fields(config):
            assert f.name in args, f"{config.__name__}.{f.name} has no EngineArgs field"
            assert args[f.name].default == f.default, f"{f.name}: EngineArgs and {config.__name__} differ"
            assert args[f.name].metadata["help"] == f.metadata["help"], f.name
            assert f.name not in seen, f"{f.name} is in two sub-configs"
            seen.add(f.name)
    assert set(args) - seen == NOT_IN_A_SUB_CONFIG


def test_serve_has_a_flag_for_every_option_and_its_defaults_are_the_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ns = build_parser().parse_args(["serve"])
    assert server_args_from(ns) == ServerArgs()
    assert engine_args_from(ns) == EngineArgs()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for f in dataclasses.fields(ServerArgs):
        assert f.metadata["help"], f.name
        assert (f.metadata["flag"] or "--" + f.name.replace("_", "-")) in help_text
    for f in dataclasses.fields(EngineArgs):
        assert f.metadata["help"], f.name
        if f.name != "model":
            assert "--" + f.name.replace("_", "-") in help_text


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--served-model-name", "a", "b"], {"served_model_names": ("a", "b")}),
        (["--disable-playground", "--port", "9000"], {"disable_playground": True, "port": 9000}),
        (["--request-body-timeout", "2.5"], {"request_body_timeout": 2.5}),
        (["--tool-call-parser", "hermes", "--enable-auto-tool-choice"], {"auto_tool_parser": "hermes"}),
    ],
)
def test_server_flags_parse_into_server_args(argv: list[str], expected: dict[str, object]) -> None:
    args = server_args_from(build_parser().parse_args(["serve", *argv]))
    assert {name: getattr(args, name) for name in expected} == expected


def test_a_bad_choice_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--uvicorn-log-level", "loud"])
    assert "--uvicorn-log-level" in capsys.readouterr().err
