"""Finding and starting the peers we compare against. Each lives in its own interpreter (a separate
virtual environment, so that its torch or its build never meets ours) or is a llama.cpp program; we talk
to it through `benchmarks/common/peer_runner.py`, its server or its printed table, never by importing
it here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.peer_runner import RESULT_MARK

RUNNER = Path(__file__).with_name("peer_runner.py")


def interpreter_with(module: str, explicit: str | None) -> str | None:
    """`explicit` if given (it must import `module`), else this interpreter if it can; None otherwise."""
    python = explicit or sys.executable
    found = subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0
    if explicit and not found:
        print(f"{explicit} cannot import {module}.", file=sys.stderr)
    return python if found else None


def executable(path: str) -> str:
    """An argparse type for a llama.cpp program: a wrong path fails at once, not after our own run."""
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise argparse.ArgumentTypeError(f"{path} is not an executable file")
    return path


def gguf_of(model: str) -> Path | None:
    """The GGUF file behind `model`, which the peers load as they are; None for a safetensors folder
    or a name that is not a model here (a remote server's served name)."""
    from llmserve.model_executor.loader import resolve_model

    try:
        source = resolve_model(model)
    except ValueError:
        return None
    return source.path if source.format == "gguf" else None


def run_peer(python: str, job: dict[str, Any]) -> dict[str, float]:
    """Run `job` (see peer_runner.py) in `python`; the peer's logs pass through to our stderr."""
    proc = subprocess.run(
        [python, str(RUNNER)], input=json.dumps(job), stdout=subprocess.PIPE, text=True, check=False
    )
    marked = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not marked:
        raise RuntimeError(f"{job['peer']} runner failed (exit {proc.returncode}): {proc.stdout[-2000:]}")
    result: dict[str, float] = json.loads(marked[-1].removeprefix(RESULT_MARK))
    return result


def engine_threads() -> int:
    """The threads llmserve's engine core computes with by default, which the peers get too."""
    from llmserve.model_executor.cpu_threads import core_thread_count

    return core_thread_count(None)


def hf_folder_of(gguf: Path) -> Path:
    """The GGUF dequantized to an fp32 safetensors folder (the values llmserve computes with), for peers
    that cannot read GGUF (vLLM 0.32 dropped it). Written once per file, then reused."""
    folder = Path(tempfile.gettempdir()) / "llmserve-bench" / f"{gguf.stem}-f32"
    if (folder / "config.json").is_file():
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"writing {gguf.name} as safetensors to {folder} (once)", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    # save_pretrained refuses a model loaded from GGUF ("quantized"), though its tensors are plain fp32
    # now; so the tensors and config are written by hand, without the tied lm_head copy and the GGUF
    # quantization entry, and naming the architecture (else vLLM picks the headless LlamaModel).
    tied = model.config.tie_word_embeddings
    tensors = {
        k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")
    }
    save_file(tensors, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2))  # last: marks a complete folder
    return folder


@dataclass(frozen=True)
class BatchedBenchRow:
    """One row of llama-batched-bench's table: `sequences` prompts of `prompt_len` tokens prefilled
    together, then `output_len` tokens decoded for each, all in lockstep."""

    sequences: int
    prompt_len: int
    output_len: int
    seconds: float  # T: prefill and decode
    prompt_tok_per_s: float  # S_PP
    gen_tok_per_s: float  # S_TG: decode alone
    total_tok_per_s: float  # S: prompt and generated tokens over T

    @property
    def output_tok_per_s(self) -> float:
        """Generated tokens over the whole run, prefill included: what our offline benchmark measures."""
        return self.sequences * self.output_len / self.seconds


def batched_bench_command(
    binary: str, gguf: Path, levels: list[int], prompt_len: int, output_len: int, threads: int
) -> list[str]:
    """llama-batched-bench with a KV cache just large enough for the largest level: it skips, without a
    word, any level that does not fit."""
    return [binary, "--model", str(gguf), "--ctx-size", str(max(levels) * (prompt_len + output_len)),
            "-npp", str(prompt_len), "-ntg", str(output_len), "-npl", ",".join(map(str, levels)),
            "--threads", str(threads), "--output-format", "md"]  # fmt: skip


def run_batched_bench(
    binary: str, gguf: Path, levels: list[int], prompt_len: int, output_len: int
) -> list[BatchedBenchRow] | str:
    """llama-batched-bench at every level in one process, on our engine's threads; its rows, or why
    there are none."""
    command = batched_bench_command(binary, gguf, levels, prompt_len, output_len, engine_threads())
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    rows = parse_batched_bench(proc.stdout)
    if proc.returncode != 0 or not rows:
        print(proc.stdout[-2000:] + proc.stderr[-3000:], file=sys.stderr)
        return f"failed (exit {proc.returncode}; its output is above)"
    return rows


def parse_batched_bench(output: str) -> list[BatchedBenchRow]:
    """The rows of llama-batched-bench's markdown table, read by column name (its log lines around the
    table are skipped)."""
    lines = [line.strip().strip("|") for line in output.splitlines() if line.lstrip().startswith("|")]
    header = next(([c.strip() for c in line.split("|")] for line in lines if "S_TG t/s" in line), None)
    rows = []
    for line in lines:
        cells = [c.strip() for c in line.split("|")]
        if header is None or len(cells) != len(header) or not all(_is_number(c) for c in cells):
            continue
        row = dict(zip(header, map(float, cells)))
        rows.append(
            BatchedBenchRow(
                sequences=int(row["B"]),
                prompt_len=int(row["PP"]),
                output_len=int(row["TG"]),
                seconds=row["T s"],
                prompt_tok_per_s=row["S_PP t/s"],
                gen_tok_per_s=row["S_TG t/s"],
                total_tok_per_s=row["S t/s"],
            )
        )
    return rows


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
