"""The benchmarks' results files and the README table built from them, without running an engine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.results import command_line, write_results
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


def test_smaller_workload_is_a_prefix_of_the_larger() -> None:
    args = argparse.Namespace(seed=0, min_input=32, max_input=512, output_len=128)
    small, large = make_workload(args, 64, 1000), make_workload(args, 256, 1000)
    assert large.prompts[:64] == small.prompts
    assert all(32 <= len(p) <= 512 for p in large.prompts)


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
