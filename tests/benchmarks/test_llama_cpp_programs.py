"""llama.cpp's own programs as peers: the command lines we start them with, llama-batched-bench's table
read into figures, and how both are set beside ours, without running either."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, cast

import pytest

from benchmarks.common.peers import BatchedBenchRow, batched_bench_command, executable, parse_batched_bench
from benchmarks.common.servers import llama_server_command
from benchmarks.serving import Report, print_reports
from benchmarks.throughput import Timing, Workload, report_batched_bench

# The standard output of llama-batched-bench (llama.cpp 0.5.0-dev, CPU build) on SmolLM2-135M Q4_1,
# `--ctx-size 48 -npp 16 -ntg 8 -npl 1,2 --threads 2 --output-format md`; its log goes to stderr.
BATCHED_BENCH_OUTPUT = """\

llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    1 |     24 |    0.092 |   173.00 |    0.095 |    84.03 |    0.188 |   127.87 |
|    16 |      8 |    2 |     48 |    0.178 |   179.34 |    0.159 |   100.42 |    0.338 |   142.11 |

"""  # noqa: E501 (as printed)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_llama_server_gets_a_slot_per_stream_each_with_the_requests_context() -> None:
    command = llama_server_command("/bin/llama-server", Path("m.gguf"), 8080, 32, 448, threads=2)
    assert command[0] == "/bin/llama-server" and "--cont-batching" in command
    assert flag(command, "--parallel") == "32" and flag(command, "--ctx-size") == str(32 * 448)
    assert flag(command, "--threads") == "2" and flag(command, "--port") == "8080"


def test_batched_bench_context_holds_the_largest_level() -> None:
    command = batched_bench_command("/bin/llama-batched-bench", Path("m.gguf"), [1, 64], 128, 128, 2)
    assert flag(command, "-npl") == "1,64" and flag(command, "--ctx-size") == str(64 * 256)
    assert [flag(command, f) for f in ("-npp", "-ntg", "--threads")] == ["128", "128", "2"]


def test_batched_bench_table_is_read_by_column_name() -> None:
    one, two = parse_batched_bench(BATCHED_BENCH_OUTPUT)
    assert one == BatchedBenchRow(1, 16, 8, 0.188, 173.00, 84.03, 127.87)
    assert (two.sequences, two.seconds, two.gen_tok_per_s) == (2, 0.338, 100.42)
    assert two.output_tok_per_s == pytest.approx(2 * 8 / 0.338)
    assert parse_batched_bench("main: error: unable to load model\n") == []


def test_a_program_path_must_be_executable(tmp_path: Path) -> None:
    program = tmp_path / "llama-server"
    program.write_text("")
    with pytest.raises(argparse.ArgumentTypeError):
        executable(str(program))
    program.chmod(0o755)
    assert executable(str(program)) == str(program)


def test_batched_bench_ratio_is_of_whole_runs_and_a_missing_level_is_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = argparse.Namespace(batched_bench_input=128, output_len=128)
    works = [Workload([[1] * 128], 128), Workload([[1] * 128] * 64, 128)]
    theirs = [BatchedBenchRow(1, 128, 128, 2.0, 1000.0, 91.0, 128.0)]
    result = report_batched_bench(args, works, [Timing(4.0, 50.0), Timing(60.0, 200.0)], theirs)
    # the results file's dict types its values as object; "levels" is a list of dicts
    one, many = cast(list[dict[str, Any]], result["levels"])
    assert one["llmserve"] == {
        "seconds": 4.0,
        "total_tok_per_s": 64.0,
        "output_tok_per_s": 32.0,
        "gen_tok_per_s": 50.0,
    }
    assert one["llama_batched_bench"]["output_tok_per_s"] == 64.0 and many["llama_batched_bench"] is None
    out = capsys.readouterr().out
    assert "0.50x" in out  # their 2 s over our 4 s
    assert f"{50 / 91:.2f}x" in out  # decode phases, both measured: ours 50.0 tok/s, their S_TG 91


def test_serving_ratios_are_ours_over_each_peer(capsys: pytest.CaptureFixture[str]) -> None:
    def served(name: str, tok_per_s: float) -> Report:
        return Report(name, 4, 0, 0.1, 0.2, 0.01, tok_per_s, 1.0)

    print_reports([served("llmserve", 60.0), served("llama-cpp", 30.0), served("llama-server", 120.0)])
    header, *_, tok_per_s, _requests, _done = capsys.readouterr().out.splitlines()
    assert header.split()[-2:] == ["llmserve/llama-cpp", "llmserve/llama-server"]
    assert tok_per_s.split()[-2:] == ["2.00x", "0.50x"]


def test_a_row_only_our_server_has_prints_without_a_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    ours = Report("llmserve", 4, 0, 0.1, 0.2, 0.01, 60.0, 1.0, memory_gib={"RSS": 1.5})
    print_reports([ours, Report("llama-server", 4, 0, 0.1, 0.2, 0.01, 30.0, 1.0)])
    rss = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("RSS (GiB)"))
    assert rss.split()[2:] == ["1.50", "-", "-"]
