"""Regenerates the results table in README.md's Performance section from the benchmarks' JSON results,
so that every figure there was printed by a script, with the command that printed it.

    .venv/bin/python -m benchmarks.report                         # run every benchmark, then rewrite
    .venv/bin/python -m benchmarks.report --only throughput prefix --llama-cpp-python PY --vllm-python PY
    .venv/bin/python -m benchmarks.report --only throughput serving \\
        --llama-batched-bench BIN/llama-batched-bench --llama-server BIN/llama-server
    .venv/bin/python -m benchmarks.report --from benchmarks/results   # rewrite from existing files

The benchmarks run one after another (never two at once: they would share the cores), each with its
defaults plus `--json DIR/NAME.json`; the table is built from every results file in DIR, so `--only`
refreshes some rows and keeps the others. The table, and a PNG beside the results (DIR/
output_tokens_per_s.png: output tokens/s, ours and the peers', by concurrent streams and by batch), replace
what lies between the markers `<!-- results:start -->` and `<!-- results:end -->`; nothing outside them
changes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no screen
from matplotlib import pyplot as plt  # noqa: E402

from benchmarks.common.results import portable_command  # noqa: E402

START, END = "<!-- results:start -->", "<!-- results:end -->"
BENCHMARKS = ("throughput", "latency", "serving", "prefix")
Row = tuple[str, str, str, str]  # what, command, llmserve, peers
PEER_NAMES = {
    "hf": "HF `generate()` batched",
    "llama-cpp": "llama-cpp-python",
    "vllm": "vLLM CPU",
    "llama-server": "llama.cpp `llama-server`",
    "llama-batched-bench": "llama.cpp `llama-batched-bench`",
}


def run_benchmarks(names: list[str], out: Path, args: argparse.Namespace) -> None:
    for name in names:
        extra: list[str] = []
        if name in ("throughput", "serving") and args.llama_cpp_python:
            extra += ["--llama-cpp-python", args.llama_cpp_python]
        if name == "serving" and args.llama_cpp_python:
            extra += ["--compare-llama-cpp"]
        if name == "throughput" and args.vllm_python:
            extra += ["--vllm-python", args.vllm_python]
        if name in ("throughput", "latency") and args.llama_batched_bench:
            extra += ["--llama-batched-bench", args.llama_batched_bench]
        if name == "serving" and args.llama_server:
            extra += ["--llama-server", args.llama_server]
        command = [sys.executable, "-m", f"benchmarks.{name}", *extra, "--json", str(out / f"{name}.json")]
        print("running:", " ".join(command), flush=True)
        subprocess.run(command, check=True)


def ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:.0f} ms" if value >= 100 else f"{value:.1f} ms"


def throughput_rows(doc: dict[str, Any]) -> list[Row]:
    r = doc["results"]
    rows = []
    for w in r["workloads"]:
        rates, ours = w["tok_per_s"], w["tok_per_s"]["llmserve"]
        peers = [
            f"{PEER_NAMES.get(n, n)}: {v:.1f} tok/s ({ours / v:.2f}×)"
            for n, v in rates.items()
            if n != "llmserve"
        ]
        peers += [f"{PEER_NAMES.get(n, n)}: skipped" for n in w["skipped"]]
        lo, hi = r["input"]
        what = f"offline, {w['num_prompts']} prompts of {lo}–{hi} tokens, {r['output_len']} out"
        rows.append((what, doc["command"], f"{ours:.1f} tok/s", "; ".join(peers) or "—"))
    return rows + batched_bench_rows(doc)


def batched_bench_rows(doc: dict[str, Any]) -> list[Row]:
    """Our runs of llama-batched-bench's shape beside its figures, when the throughput run had it."""
    bench = doc["results"].get("llama_batched_bench")
    if not bench:
        return []
    name, rows = PEER_NAMES["llama-batched-bench"], []
    for level in bench["levels"]:
        mine, theirs = level["llmserve"], level["llama_batched_bench"]
        ours, our_tg = mine["output_tok_per_s"], mine.get("gen_tok_per_s")
        if theirs is None:
            peer = f"{name}: skipped"
        else:
            out, tg = theirs["output_tok_per_s"], theirs["gen_tok_per_s"]
            peer = f"{name}: {out:.1f} tok/s ({ours / out:.2f}×); decode phase (S_TG) {tg:.1f} tok/s"
            if our_tg is not None:
                peer += f", ours {our_tg:.1f} ({our_tg / tg:.2f}×)"
        count = f"{level['sequences']} prompt{'s' if level['sequences'] != 1 else ''}"
        sizes = f"{count} of {bench['prompt_len']} tokens, {bench['output_len']} out"
        what = f"offline, {sizes} (llama-batched-bench's shape)"
        rows.append((what, doc["command"], f"{ours:.1f} tok/s", peer))
    return rows


def latency_rows(doc: dict[str, Any]) -> list[Row]:
    r, rows = doc["results"], []
    if "decode" in r:
        peak = r["decode"]["peak_gb_s"]
        theirs = r["decode"].get("llama_batched_bench_tok_per_s")
        for dtype, d in r["decode"]["dtypes"].items():
            figure = (
                f"{d['tok_per_s']:.1f} tok/s; {d['weight_mb']:.0f} MB/token ({d['formats']}): "
                f"{d['achieved_gb_s']:.1f} GB/s = {d['fraction_of_peak']:.0%} of {peak:.1f} GB/s measured"
            )
            peer = "—"
            if isinstance(theirs, float):
                ratio = d["tok_per_s"] / theirs
                peer = f"{PEER_NAMES['llama-batched-bench']}: {theirs:.1f} tok/s ({ratio:.2f}×)"
            rows.append((f"single-stream decode, {dtype}", doc["command"], figure, peer))
    if "async" in r:
        for level, d in r["async"]["concurrency"].items():
            figure = f"TTFT p50 {d['ttft_p50_ms']:.0f} ms, TPOT p50 {d['tpot_p50_ms']:.1f} ms"
            sizes = f"{r['async']['input_len']} in, {r['async']['output_len']} out"
            rows.append((f"`AsyncLLM` streaming, {level} at once, {sizes}", doc["command"], figure, "—"))
    if "hop" in r:
        h = r["hop"]
        figure = f"{h['zmq_ms_per_step']:.1f} ms/step vs {h['inprocess_ms_per_step']:.1f} in-process"
        rows.append(("engine core process hop, batch 8", doc["command"], figure, "—"))
    return rows


def _serving_cell(report: dict[str, Any]) -> str:
    return (
        f"TTFT p50 {ms(report['ttft_p50'])}, p99 {ms(report['ttft_p99'])}; ITL p50 {ms(report['itl_p50'])}; "
        f"{report['output_tokens_per_s']:.1f} tok/s"
    )


def serving_rows(doc: dict[str, Any]) -> list[Row]:
    rows = []
    for level in doc["results"]["levels"]:
        w, (ours, *peers) = level["workload"], level["reports"]
        streams = f"{w['concurrency']} stream{'s' if w['concurrency'] != 1 else ''}"
        what = f"server, {streams}, {w['input_len']} words in, {w['output_len']} out"
        ratios = [ours["output_tokens_per_s"] / (p["output_tokens_per_s"] or float("nan")) for p in peers]
        peer = "; ".join(
            f"{PEER_NAMES.get(p['name'], p['name'])}: {_serving_cell(p)} (tok/s {x:.2f}×)"
            for p, x in zip(peers, ratios)
        )
        rows.append((what, doc["command"], _serving_cell(ours), peer or "—"))
    return rows


def prefix_rows(doc: dict[str, Any]) -> list[Row]:
    r = doc["results"]
    on, off = r["on"], r["off"]
    what = (
        f"{r['num_requests']} requests sharing a {r['prefix_len']}-token prefix, {r['concurrency']} in flight"
    )
    figure = (
        f"TTFT p50 {on['ttft_p50_ms']:.0f} ms cached vs {off['ttft_p50_ms']:.0f} ms uncached "
        f"({on['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}, target ≤ 0.33); hit rate {on['hit_rate']:.0%}"
    )
    if "identical_outputs" in r:
        figure += f"; outputs identical in {r['identical_outputs']} of {r['num_requests']}"
    return [(what, doc["command"], figure, "—")]


FORMATTERS = {
    "throughput": throughput_rows,
    "latency": latency_rows,
    "serving": serving_rows,
    "prefix": prefix_rows,
}


def machine_line(docs: list[dict[str, Any]]) -> str:
    m = docs[0]["machine"]
    dates = sorted({d["machine"]["date"] for d in docs})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    load = max(d["machine"]["foreign_load_cores"] for d in docs)
    threads = f", OMP_NUM_THREADS={m['omp_num_threads']}" if m["omp_num_threads"] else ""
    models = sorted({_model(d) for d in docs} - {""})
    return (
        f"Machine: {m['cpu']}, {m['cores']} cores{threads}, {m['memory_gib']} GiB; measured {when}; "
        f"other work at the start of each run: at most {load:.1f} cores. Model: {', '.join(models)}."
    )


def _model(doc: dict[str, Any]) -> str:
    results = doc["results"]
    return str(results.get("model") or results.get("decode", {}).get("model") or "")


def render(docs: list[dict[str, Any]]) -> str:
    note = "Ratios in parentheses are llmserve's figure over the peer's."
    lines = [machine_line(docs), note, "", "| what | command | llmserve | peers |", "|---|---|---|---|"]
    for doc in docs:
        for what, command, ours, peers in FORMATTERS[doc["benchmark"]](doc):
            lines.append(f"| {what} | `{portable_command(shlex.split(command))}` | {ours} | {peers} |")
    return "\n".join(lines)


def figure(docs: list[dict[str, Any]], path: Path) -> bool:
    """A PNG of output tokens/s, ours and each peer's: the server's by concurrent streams, offline by
    prompts in one batch. False (and no file) when the results hold neither."""
    series: dict[str, dict[str, dict[int, float]]] = {"server": {}, "offline": {}}
    for doc in docs:
        if doc["benchmark"] == "serving":
            for level in doc["results"]["levels"]:
                for r in level["reports"]:
                    by_name = series["server"].setdefault(r["name"], {})
                    by_name[level["workload"]["concurrency"]] = r["output_tokens_per_s"]
        if doc["benchmark"] == "throughput":
            for w in doc["results"]["workloads"]:
                for name, rate in w["tok_per_s"].items():
                    series["offline"].setdefault(name, {})[w["num_prompts"]] = rate
    panels = [(title, lines) for title, lines in series.items() if lines]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels):
        for name, points in lines.items():
            xs = sorted(points)
            ax.plot(
                xs, [points[x] for x in xs], marker="o", label=PEER_NAMES.get(name, name).replace("`", "")
            )
        ax.set_xscale("log", base=2)
        ticks = sorted({x for points in lines.values() for x in points})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streams" if title == "server" else "prompts in one batch")
        ax.set_ylabel("output tokens/s")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    machine = docs[0]["machine"]
    fig.suptitle(
        f"{machine['cpu']}, {machine['cores']} cores, {machine['date']}: {_model(docs[0])}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def rewrite(readme: Path, table: str) -> None:
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no {START} ... {END} block to rewrite.")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--from", dest="source", type=Path, default=None, help="read results here; run nothing"
    )
    parser.add_argument("--results-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--llama-cpp-python", default=None)
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--llama-server", default=None, help="llama.cpp's binary, for serving")
    parser.add_argument(
        "--llama-batched-bench", default=None, help="llama.cpp's binary, for throughput and latency"
    )
    parser.add_argument("--readme", type=Path, default=Path("README.md"))
    args = parser.parse_args()
    folder = args.source or args.results_dir
    if args.source is None:
        folder.mkdir(parents=True, exist_ok=True)
        run_benchmarks(args.only, folder, args)
    # Every results file there, not only those just run: rerunning one benchmark refreshes its rows.
    docs = [
        json.loads((folder / f"{n}.json").read_text()) for n in BENCHMARKS if (folder / f"{n}.json").exists()
    ]
    if not docs:
        raise SystemExit(f"no results in {folder}.")
    table, picture = render(docs), folder / "output_tokens_per_s.png"
    if figure(docs, picture):
        link = Path(os.path.relpath(picture, args.readme.parent)).as_posix()
        table += f"\n\n![Output tokens/s, ours and the peers']({link})"
    rewrite(args.readme, table)
    print(f"{args.readme}: table rewritten from {len(docs)} results file(s) in {folder}.")


if __name__ == "__main__":
    main()
