"""The benchmark and eval clients that vLLM users already run, run briefly against a real `llmserve serve`:
guidellm and aiperf (synthetic load with fixed prompt and output lengths) and lm-evaluation-harness (a
tiny local task, through both its completions and its chat model). Each run is checked from both ends:
what the client reports (every request succeeded, the token counts) and what the server counted on
/metrics. The clients live in a venv of their own that `make clients` (part of `make test`)
makes; a missing one fails."""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from tests.entrypoints.conftest import MODEL
from tests.entrypoints.remote_server import THREAD_ENV, RemoteServer

REPO = Path(__file__).resolve().parents[2]
CLIENTS_BIN = REPO / ".venv-clients" / "bin"
LM_EVAL_TASKS = REPO / "tests" / "fixtures" / "lm_eval"
CLIENT_TIMEOUT_S = 300
REQUESTS = 8
CONCURRENCY = 4
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
LM_EVAL_LIMIT = 3  # of the task's 4 questions
MC_CHOICES = 3  # every question's number of choices: one loglikelihood request each
GEN_MAX_TOKENS = 8  # the generate task's max_gen_toks
# Nothing is downloaded: tokenizers and datasets come from local paths. aiperf is the exception to
# HF_HUB_OFFLINE: with it set, aiperf looks a local tokenizer folder up in the hub's cache and fails.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def client(name: str) -> str:
    path = CLIENTS_BIN / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: `make clients` (part of `make test`) installs it.")
    return str(path)


def run_client(args: list[str], cwd: Path, env: dict[str, str]) -> None:
    """Runs one client to completion; a non-zero exit fails the test with the end of its output."""
    done = subprocess.run(
        args,
        cwd=cwd,
        env={**os.environ, **THREAD_ENV, **env},
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )
    if done.returncode != 0:
        output = (done.stdout + done.stderr)[-5000:]
        pytest.fail(f"{Path(args[0]).name} exited with {done.returncode}:\n{output}")


@dataclass(frozen=True)
class ServerCounts:
    """The server's own tallies from /metrics, to compare with what a client says it sent and got."""

    finished: dict[str, float]  # requests by finish reason (in a difference, the reasons seen)
    prompt_tokens: float
    generation_tokens: float

    def minus(self, before: ServerCounts) -> ServerCounts:
        return ServerCounts(
            {
                reason: n - before.finished.get(reason, 0.0)
                for reason, n in self.finished.items()
                if n != before.finished.get(reason, 0.0)
            },
            self.prompt_tokens - before.prompt_tokens,
            self.generation_tokens - before.generation_tokens,
        )


def server_counts(server: RemoteServer) -> ServerCounts:
    finished: dict[str, float] = {}
    totals: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if name == "llmserve:request_success_total":
            reason = name_labels.split('finished_reason="', 1)[1].split('"', 1)[0]
            finished[reason] = float(value)
        elif name in ("llmserve:prompt_tokens_total", "llmserve:generation_tokens_total"):
            totals[name] = float(value)
    return ServerCounts(
        finished, totals["llmserve:prompt_tokens_total"], totals["llmserve:generation_tokens_total"]
    )


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer: PreTrainedTokenizerBase, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's tokenizer (built from the GGUF) saved as Hugging Face files, which the clients load."""
    return Path(tokenizer.save_pretrained(tmp_path_factory.mktemp("tokenizer"))[0]).parent


def chat_prompt_tokens(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> int:
    """The prompt's length as the server renders a chat: its template, text parts joined."""
    conversation = [
        {
            "role": m["role"],
            "content": m["content"]
            if isinstance(m["content"], str)
            else "".join(part["text"] for part in m["content"]),
        }
        for m in messages
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(str(rendered), add_special_tokens=False))


def test_guidellm_completions(
    server: RemoteServer, tokenizer: PreTrainedTokenizerBase, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """guidellm's streamed completions, with continuous usage stats and ignore_eos as it always sends."""
    report = tmp_path / "benchmarks.json"
    scenario = {
        "spec": {
            "backend": {
                "kind": "openai_http",
                "target": server.url,
                "model": MODEL,
                "request_format": "/v1/completions",
            },
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer_dir)},
            "profile": {"kind": "concurrent", "streams": [CONCURRENCY]},
            "data": [
                {"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}
            ],
            "constraints": [{"kind": "max_requests", "count": REQUESTS}],
            "seed": {"kind": "static", "value": 0},
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    before = server_counts(server)
    run_client(
        [client("guidellm"), "run", "-c", str(tmp_path / "scenario.json"), "--disable-console-interactive"],
        tmp_path,
        OFFLINE,
    )
    counted = server_counts(server).minus(before)

    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    state = benchmark["scheduler_state"]
    outcomes = ("successful_requests", "errored_requests", "cancelled_requests")
    assert {k: state[k] for k in outcomes} == dict(zip(outcomes, (REQUESTS, 0, 0)))
    requests = benchmark["requests"]
    assert (len(requests["successful"]), requests["errored"], requests["incomplete"]) == (REQUESTS, [], [])
    prompt_tokens = 0
    for request in requests["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert body["ignore_eos"] is True
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
        assert request["info"]["timings"]["token_iterations"] == OUTPUT_TOKENS
        expected_prompt = len(tokenizer.encode(body["prompt"]))
        assert request["input_metrics"]["text_tokens"] == expected_prompt
        prompt_tokens += expected_prompt
    assert counted == ServerCounts({"length": REQUESTS}, prompt_tokens, REQUESTS * OUTPUT_TOKENS)


def test_aiperf_chat(
    server: RemoteServer, tokenizer: PreTrainedTokenizerBase, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """aiperf's streamed chat, with the server's token counts on every chunk (continuous usage stats)."""
    artifacts = tmp_path / "artifacts"
    before = server_counts(server)
    run_client(
        [
            client("aiperf"), "profile",
            "--model", MODEL,
            "--url", server.url,
            "--endpoint-type", "chat",
            "--streaming",
            "--tokenizer", str(tokenizer_dir),
            "--isl", str(PROMPT_TOKENS), "--isl-stddev", "0",
            "--osl", str(OUTPUT_TOKENS), "--osl-stddev", "0",
            "--extra-inputs", "ignore_eos:true",
            "--use-server-token-count", "--per-chunk-usage",
            "--request-count", str(REQUESTS),
            "--concurrency", str(CONCURRENCY),
            "--random-seed", "0",
            "--ui-type", "none",
            "--artifact-dir", str(artifacts),
        ],
        tmp_path,
        {},
    )  # fmt: skip
    counted = server_counts(server).minus(before)

    summary = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and summary["request_error_rate"]["avg"] == 0
    assert summary["is_complete"] and not summary["was_cancelled"]
    assert summary["completed_request_count"]["avg"] == REQUESTS
    assert summary["osl_mismatch_count"]["avg"] == 0
    records = [json.loads(line) for line in (artifacts / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS
    prompts = {
        session["session_id"]: session["payloads"][0]
        for session in json.loads((artifacts / "inputs.json").read_text())["data"]
    }
    prompt_tokens = 0
    for record in records:
        metrics = record["metrics"]
        assert record.get("error") is None
        assert metrics["output_sequence_length"]["value"] == OUTPUT_TOKENS
        assert metrics["usage_completion_tokens"]["value"] == OUTPUT_TOKENS
        payload = prompts[record["metadata"]["conversation_id"]]
        assert payload["stream_options"]["continuous_usage_stats"] is True
        expected_prompt = chat_prompt_tokens(tokenizer, payload["messages"])
        assert metrics["usage_prompt_tokens"]["value"] == expected_prompt
        prompt_tokens += expected_prompt
    assert counted == ServerCounts({"length": REQUESTS}, prompt_tokens, REQUESTS * OUTPUT_TOKENS)


def run_lm_eval(model_type: str, model_args: str, tasks: list[str], flags: list[str], out: Path) -> None:
    run_client(
        [
            client("lm_eval"),
            "--model", model_type,
            "--model_args", f"model={MODEL},num_concurrent={CONCURRENCY},max_retries=1,{model_args}",
            "--include_path", str(LM_EVAL_TASKS),
            "--tasks", ",".join(tasks),
            "--limit", str(LM_EVAL_LIMIT),
            "--output_path", str(out),
            "--log_samples",
            *flags,
        ],
        LM_EVAL_TASKS,  # the tasks' data_files are relative to it
        {**OFFLINE, "HF_DATASETS_CACHE": str(out / "datasets")},
    )  # fmt: skip


def lm_eval_samples(out: Path, task: str) -> list[dict[str, Any]]:
    """The task's logged samples, after checking the results' sample counts."""
    (results,) = out.glob("*/results_*.json")
    counts = json.loads(results.read_text())["n-samples"][task]
    assert counts == {"original": 4, "effective": LM_EVAL_LIMIT}
    (samples,) = out.glob(f"*/samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert sorted(row["doc_id"] for row in rows) == list(range(LM_EVAL_LIMIT))
    return rows


def check_generations(rows: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase) -> None:
    """Every question got a text, stopped at the task's newline or at its length."""
    for row in rows:
        (text,) = row["filtered_resps"]
        assert isinstance(text, str) and "\n" not in text
        assert len(tokenizer.encode(text)) <= GEN_MAX_TOKENS + 1  # a re-encoding may merge differently


def test_lm_eval_local_completions(
    server: RemoteServer, tokenizer: PreTrainedTokenizerBase, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Generation and multiple choice by loglikelihood (echo with logprobs, prompts as token ids)."""
    before = server_counts(server)
    run_lm_eval(
        "local-completions",
        f"base_url={server.url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer_dir}",
        ["llmserve_tiny_gen", "llmserve_tiny_mc"],
        [],
        tmp_path,
    )
    counted = server_counts(server).minus(before)
    # One request per question, and one per choice of each multiple-choice question; none failed.
    assert set(counted.finished) <= {"stop", "length"}
    assert sum(counted.finished.values()) == LM_EVAL_LIMIT * (1 + MC_CHOICES)

    check_generations(lm_eval_samples(tmp_path, "llmserve_tiny_gen"), tokenizer)
    for row in lm_eval_samples(tmp_path, "llmserve_tiny_mc"):
        assert len(row["resps"]) == MC_CHOICES
        for (context, continuation), ((loglikelihood, _),) in zip(
            ((a["arg_0"], a["arg_1"]) for a in row["arguments"].values()), row["resps"]
        ):
            # The same sum from the server's prompt logprobs, a route that lm-eval does not use.
            assert float(loglikelihood) == pytest.approx(
                continuation_logprob(server, tokenizer, context, continuation), abs=0.05
            )


def continuation_logprob(
    server: RemoteServer, tokenizer: PreTrainedTokenizerBase, context: str, continuation: str
) -> float:
    whole = tokenizer.encode(context + continuation)
    start = len(tokenizer.encode(context))
    response = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": whole, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0},
        timeout=60,
    )
    response.raise_for_status()
    logprobs = response.json()["choices"][0]["prompt_logprobs"]
    total = sum(logprobs[i][str(whole[i])]["logprob"] for i in range(start, len(whole)))
    assert math.isfinite(total) and total < 0
    return float(total)


def test_lm_eval_local_chat_completions(
    server: RemoteServer, tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """lm-eval's chat model (generation only: it has no loglikelihood), the model's chat template applied."""
    before = server_counts(server)
    run_lm_eval(
        "local-chat-completions",
        f"base_url={server.url}/v1/chat/completions",
        ["llmserve_tiny_gen"],
        ["--apply_chat_template"],
        tmp_path,
    )
    counted = server_counts(server).minus(before)
    assert set(counted.finished) <= {"stop", "length"}
    assert sum(counted.finished.values()) == LM_EVAL_LIMIT

    rows = lm_eval_samples(tmp_path, "llmserve_tiny_gen")
    check_generations(rows, tokenizer)
    assert all(row["filtered_resps"][0] for row in rows)  # the chat template makes the model answer
