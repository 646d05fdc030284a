"""The soak benchmark's request mix covers every shape it promises, reproducibly; its verdicts fail a
server whose memory grows more than the tolerance after the warm-up (each process on its own in the
duration mode), that keeps requests or KV blocks, or that stalls; and a few seconds of the duration
mode against the real server sample both processes and the gauges, and end drained."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import benchmarks.soak
from benchmarks.common.soak_duration import Tally, Tick, baseline_tick, duration_failures, peak_tick
from benchmarks.common.soak_mix import LONG_PROMPT_SLACK, parse_gauges, process_rss
from benchmarks.soak import (
    WARMUP_REQUESTS,
    Sample,
    draw_shape,
    failures,
    memory_growth,
    parse_args,
    settled_rss,
)
from tests.entrypoints.remote_server import THREAD_ENV

MIB = 1 << 20
IDLE = {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "kv_cache_usage_perc": 0.0}


def test_the_mix_holds_every_shape_and_is_seeded() -> None:
    rng = random.Random(1)
    shapes = [draw_shape(rng, "m") for _ in range(2000)]
    paths = {s.path for s in shapes}
    assert paths == {"/completions", "/chat/completions"}
    assert any(s.body["stream"] for s in shapes) and not all(s.body["stream"] for s in shapes)
    assert any(s.body.get("n") == 2 for s in shapes)
    assert any("logprobs" in s.body for s in shapes)
    invalid = [s for s in shapes if s.expect_status == 400]
    assert invalid and all(s.body["max_tokens"] == -1 for s in invalid)
    dropped = [s for s in shapes if s.drop_after_first_chunk]
    assert dropped and all(s.body["stream"] and s.expect_status == 200 for s in dropped)
    rng_a, rng_b = random.Random(5), random.Random(5)
    assert [draw_shape(rng_a, "m") for _ in range(50)] == [draw_shape(rng_b, "m") for _ in range(50)]


def test_memory_growth_is_measured_from_the_end_of_the_warm_up() -> None:
    mib = 1 << 20
    warming = Sample(WARMUP_REQUESTS // 2, 50 * mib)  # the pool still faulting in: not the baseline
    samples = [warming, Sample(WARMUP_REQUESTS, 100 * mib), Sample(1000, 130 * mib), Sample(2000, 105 * mib)]
    assert memory_growth(samples) == pytest.approx(0.05)  # the last sample against the first after 100


def test_growth_beyond_ten_percent_fails_and_within_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["soak"])
    tolerance = parse_args().tolerance
    assert tolerance == 0.10
    idle = {"num_requests_running": 0.0, "num_requests_waiting": 0.0}
    assert failures(0.099, tolerance, [], idle) == failures(tolerance, tolerance, [], idle) == []
    assert failures(-0.05, tolerance, [], idle) == []
    assert failures(0.101, tolerance, [], idle) == ["resident memory grew +10.1%, more than 10%"]
    assert failures(0.0, tolerance, ["HTTP 500"], idle) == ["unexpected answers: 1"]
    left = {"num_requests_running": 1.0, "num_requests_waiting": 0.0}
    assert len(failures(0.0, tolerance, [], left)) == 1


def test_the_first_sample_waits_for_the_kv_pool_to_be_faulted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([100, 900, 2000, 3000, 3010, 3011])  # MiB: the pool coming in, then settled
    monkeypatch.setattr(benchmarks.soak, "process_rss", lambda pid: {"core": next(readings)})
    monkeypatch.setattr(benchmarks.soak.time, "sleep", lambda s: None)
    assert settled_rss(1) == 3010


def test_long_prompts_fill_the_context_up_to_max_tokens() -> None:
    max_model_len = 256
    rng = random.Random(3)
    shapes = [draw_shape(rng, "m", list(range(max_model_len))) for _ in range(1000)]
    long = [s for s in shapes if isinstance(s.body.get("prompt"), list)]
    assert 20 < len(long) < 100  # about 5%
    for shape in long:
        prompt, max_tokens = shape.body["prompt"], shape.body["max_tokens"]
        assert isinstance(prompt, list) and isinstance(max_tokens, int)
        total = len(prompt) + max_tokens
        assert max_model_len - LONG_PROMPT_SLACK <= total <= max_model_len
        assert shape.path == "/completions" and shape.expect_status == 200


def test_each_process_is_measured_on_its_own() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
    try:
        for _ in range(100):  # until the child has touched its 64 MiB
            rss = process_rss(os.getpid())
            if rss.get(f"child {child.pid}", 0) > 64 * MIB:
                break
            time.sleep(0.1)
        assert set(rss) == {"api_server", f"child {child.pid}"} and rss[f"child {child.pid}"] > 64 * MIB
    finally:
        child.kill()
        child.wait()


def test_gauges_are_read_from_prometheus_text() -> None:
    text = (
        "# HELP llmserve:num_requests_running Requests in the running batch.\n"
        'llmserve:num_requests_running{model_name="m"} 3.0\n'
        'llmserve:num_requests_waiting{model_name="m"} 12.0\n'
        'llmserve:kv_cache_usage_perc{model_name="m"} 0.25\n'
        'llmserve:num_preemptions_total{model_name="m"} 7.0\n'
    )
    assert parse_gauges(text) == {
        "num_requests_running": 3.0,
        "num_requests_waiting": 12.0,
        "kv_cache_usage_perc": 0.25,
    }


def tick(t: float, api: int, core: int, **gauges: float) -> Tick:
    return Tick(t, {"api_server": api * MIB, "engine_core": core * MIB}, {**IDLE, **gauges}, 0, 0, 0)


def test_the_duration_verdict_holds_each_process_to_its_warmed_up_memory() -> None:
    ticks = [tick(0, 100, 500), tick(30, 120, 600, num_requests_waiting=40), tick(60, 125, 610)]
    baseline = baseline_tick(ticks, warmup=30)
    assert baseline is ticks[1]
    assert baseline_tick(ticks, warmup=999) is ticks[-1]  # a load shorter than the warm-up
    peak = peak_tick(ticks)
    assert peak.rss == {"api_server": 125 * MIB, "engine_core": 610 * MIB}
    assert peak.gauges["num_requests_waiting"] == 40

    def verdict(final: Tick, tally: Tally | None = None, goodput: float = 1.0) -> list[str]:
        return duration_failures(baseline, final, 0.10, tally or Tally(answered=10), goodput, 0.5)

    assert verdict(tick(90, 131, 600)) == []
    # the core shrinking cannot hide the API server's growth: each process is held on its own
    assert verdict(tick(90, 133, 400)) == [
        "api_server resident memory grew +10.8% after the warm-up, more than 10%"
    ]
    assert len(verdict(tick(90, 120, 600, kv_cache_usage_perc=0.01))) == 1
    assert len(verdict(tick(90, 120, 600, num_requests_waiting=1))) == 1
    assert verdict(tick(90, 120, 600), Tally(errors=["HTTP 500"])) == ["unexpected answers: 1"]
    stalled = verdict(tick(90, 120, 600), Tally(timed_out=50), goodput=0.1)
    assert stalled == ["answered 0.10 requests/s while overloaded, under 0.50"]


def test_a_few_seconds_of_the_duration_mode_end_drained(tmp_path: Path, default_model_path: object) -> None:
    """Against the real server: both processes sampled all along, the queue built and emptied, no
    request left and no KV block held; the verdict's tolerance is wide, a few seconds being no soak."""
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "benchmarks.soak", "--duration", "6", "--probe-seconds", "4",
               "--sample-interval", "1", "--kv-cache-memory", str(64 * MIB),
               "--tolerance", "0.5", "--json", str(out)]  # fmt: skip
    env = {**os.environ, **THREAD_ENV}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "after drain" in result.stdout
    figures = json.loads(out.read_text())["results"]
    assert figures["mode"] == "duration" and figures["failures"] == []
    assert figures["rate_rps"] == pytest.approx(2 * figures["capacity_rps"]) and figures["capacity_rps"] > 0
    assert figures["requests"]["answered"] > 0 and figures["requests"]["unexpected"] == 0
    assert all(set(s["rss"]) == {"api_server", "engine_core"} for s in figures["samples"])
    assert len(figures["samples"]) >= 4
    assert figures["peak"]["gauges"]["num_requests_running"] > 0
    assert figures["after_drain"]["gauges"] == IDLE
