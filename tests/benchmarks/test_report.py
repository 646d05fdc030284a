"""The benchmarks' results files and the README table built from them, without running an engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.common.results import command_line, write_results
from benchmarks.throughput import make_workload

MACHINE = {"cpu": "Test CPU (avx2)", "cores": 2, "memory_gib": 8, "omp_num_threads": None,
           "foreign_load_cores": 0.1, "date": "2026-01-02"}  # fmt: skip


def doc(benchmark: str, results: dict[str, object]) -> dict[str, object]:
    return {"benchmark": benchmark, "command": f"python -m benchmarks.{benchmark}", "machine": MACHINE,
            "results": results}  # fmt: skip


def test_command_line_drops_the_json_destination(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["x", "--json", "a.json", "--num-prompts", "64", "--json=b.json"])
    assert command_line("benchmarks.throughput") == "python -m benchmarks.throughput --num-prompts 64"


def test_write_results_records_command_and_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["x", "--concurrency", "8"])
    write_results(tmp_path / "r" / "prefix.json", "benchmarks.prefix", {"on": {}}, 0.25)
    written = json.loads((tmp_path / "r" / "prefix.json").read_text())
    assert written["benchmark"] == "prefix"
    assert written["command"] == "python -m benchmarks.prefix --concurrency 8"
    assert written["machine"]["foreign_load_cores"] == 0.25 and written["machine"]["cores"]


def test_workloads_share_no_prompt_for_the_prefix_cache_to_find() -> None:
    args = argparse.Namespace(seed=0, min_input=32, max_input=512, output_len=128)
    small, large = make_workload(args, 64, 1000), make_workload(args, 256, 1000)
    assert not {tuple(p[:16]) for p in small.prompts} & {tuple(p[:16]) for p in large.prompts}
    assert all(32 <= len(p) <= 512 for p in large.prompts)
    assert make_workload(args, 64, 1000).prompts == small.prompts  # seeded


def test_readme_block_is_rewritten_from_results_only(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{report.START}\nold figures\n{report.END}\nafter\n")
    throughput = {"input": [32, 512], "output_len": 128, "workloads": [
        {"num_prompts": 64, "output_tokens": 8192, "tok_per_s": {"llmserve": 60.0, "hf": 30.0},
         "skipped": {"vllm": "not installed"}}]}  # fmt: skip
    prefix = {"num_requests": 64, "prefix_len": 512, "concurrency": 8,
              "on": {"ttft_p50_ms": 100.0, "hit_rate": 0.9}, "off": {"ttft_p50_ms": 400.0}}  # fmt: skip
    report.rewrite(readme, report.render([doc("throughput", throughput), doc("prefix", prefix)]))
    text = readme.read_text()
    assert "old figures" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("after\n")
    assert "| 60.0 tok/s | HF `generate()` batched: 30.0 tok/s (2.00×); vLLM CPU: skipped |" in text
    assert "(0.25, target ≤ 0.33); hit rate 90%" in text
    assert "Test CPU (avx2), 2 cores, 8 GiB; measured 2026-01-02" in text


def test_readme_without_markers_is_refused(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n")
    with pytest.raises(SystemExit):
        report.rewrite(readme, "table")


def served(name: str, tok_per_s: float) -> dict[str, object]:
    return {"name": name, "completed": 32, "failed": 0, "ttft_p50": 0.2, "ttft_p99": 0.3, "itl_p50": 0.02,
            "output_tokens_per_s": tok_per_s, "requests_per_s": 1.0}  # fmt: skip


def test_serving_row_names_each_peer_with_our_ratio() -> None:
    reports = [served("llmserve", 120.0), served("llama-cpp", 40.0), served("llama-server", 150.0)]
    level = {"workload": {"concurrency": 32, "input_len": 128, "output_len": 64}, "reports": reports}
    [(what, _, ours, peers)] = report.serving_rows(doc("serving", {"model": "m", "levels": [level]}))
    assert what == "server, 32 streams, 128 words in, 64 out" and ours.endswith("; 120.0 tok/s")
    cell = "TTFT p50 200 ms, p99 300 ms; ITL p50 20.0 ms"
    assert peers == (
        f"llama-cpp-python: {cell}; 40.0 tok/s (tok/s 3.00×); "
        f"llama.cpp `llama-server`: {cell}; 150.0 tok/s (tok/s 0.80×)"
    )


def test_batched_bench_levels_follow_the_throughput_rows() -> None:
    bench = {"prompt_len": 128, "output_len": 128, "skipped": None, "levels": [
        {"sequences": 1, "llmserve": {"output_tok_per_s": 45.5, "gen_tok_per_s": 91.0},
         "llama_batched_bench": {"output_tok_per_s": 91.0, "gen_tok_per_s": 182.0}},
        {"sequences": 64, "llmserve": {"output_tok_per_s": 171.0}, "llama_batched_bench": None}]}  # fmt: skip
    throughput = {"input": [32, 512], "output_len": 128, "workloads": [], "llama_batched_bench": bench}
    rows = report.throughput_rows(doc("throughput", throughput))
    assert [(what, ours, peers) for what, _, ours, peers in rows] == [
        ("offline, 1 prompt of 128 tokens, 128 out (llama-batched-bench's shape)", "45.5 tok/s",
         "llama.cpp `llama-batched-bench`: 91.0 tok/s (0.50×); "
         "decode phase (S_TG) 182.0 tok/s, ours 91.0 (0.50×)"),
        ("offline, 64 prompts of 128 tokens, 128 out (llama-batched-bench's shape)", "171.0 tok/s",
         "llama.cpp `llama-batched-bench`: skipped"),
    ]  # fmt: skip


def test_single_stream_rows_carry_llama_cpp_decode_and_our_ratio() -> None:
    decode = {
        "tok_per_s": 90.0,
        "weight_mb": 84.0,
        "formats": "Q4_1",
        "achieved_gb_s": 7.6,
        "fraction_of_peak": 0.4,
    }
    doc = {
        "command": "python -m benchmarks.latency",
        "results": {"decode": {"peak_gb_s": 19.0, "dtypes": {"float32, int4": decode}}},
    }
    (row,) = report.latency_rows(doc)
    assert row[3] == "—"  # no llama.cpp run
    doc["results"]["decode"]["llama_batched_bench_tok_per_s"] = 75.0  # type: ignore[index]
    (row,) = report.latency_rows(doc)
    assert row[0] == "single-stream decode, float32, int4"
    assert "75.0 tok/s (1.20×)" in row[3]


def test_commands_name_the_peers_by_variables() -> None:
    """A path to a peer on one machine means nothing on another: the table shows the variable to set."""
    command = (
        "python -m benchmarks.serving --llama-cpp-python /opt/x/bin/python "
        "--llama-server '/home/a b/llama-server' --concurrency 8"
    )
    prefix = {"num_requests": 2, "prefix_len": 8, "concurrency": 1,
              "on": {"ttft_p50_ms": 1.0, "hit_rate": 0.5}, "off": {"ttft_p50_ms": 2.0}}  # fmt: skip
    table = report.render([{**doc("prefix", prefix), "command": command}])
    assert (
        "--llama-cpp-python $LLAMA_CPP_PYTHON --llama-server $LLAMA_CPP_BIN/llama-server --concurrency 8"
        in table
    )
    assert "/opt/x" not in table and "/home/a b" not in table


def test_the_picture_plots_the_server_and_offline_rates_and_nothing_without_them(tmp_path: Path) -> None:
    workloads = [{"num_prompts": n, "tok_per_s": {"llmserve": 2.0 * n, "vllm": 1.5 * n}} for n in (64, 256)]
    levels = [
        {
            "workload": {"concurrency": c},
            "reports": [served("llmserve", 10.0 * c), served("llama-server", 8.0 * c)],
        }
        for c in (1, 8, 32)
    ]
    docs = [
        doc("throughput", {"model": "m", "workloads": workloads}),
        doc("serving", {"model": "m", "levels": levels}),
    ]
    picture = tmp_path / "rates.png"
    assert report.figure(docs, picture)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    prefix = {"num_requests": 64, "prefix_len": 512, "concurrency": 8, "on": {}, "off": {}}
    assert not report.figure([doc("prefix", prefix)], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
