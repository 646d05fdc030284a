"""The speculative decoding benchmark's own logic (its workloads, its counts of repetition and
acceptance, its report), and one short run of it on the default model: both engines, every workload,
identical greedy outputs, and drafts where the output copies its prompt."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.spec_decode import (
    Acceptance,
    markdown,
    prose_passages,
    quote_prompt,
    repetition,
    rewrite_prompt,
)
from llmserve.contracts import SpecDecodingStats

REPO = Path(__file__).resolve().parents[2]


def test_rewrite_prompts_hold_a_real_file_and_rename_one_of_its_names() -> None:
    prompts = [str(rewrite_prompt(i, 2000)[0]["content"]) for i in range(10)]
    assert len(set(prompts)) == 10  # each round over the files renames another name
    code = prompts[0].split("```python\n")[1].split("```")[0]
    assert len(code) <= 2000 and code.endswith("\n")
    assert code in (REPO / "llmserve/scheduling/block_pool.py").read_text()
    old = prompts[0].split("renaming `")[1].split("`")[0]
    assert f"class {old}" in code or f"def {old}" in code


def test_passages_are_prose_and_questions_name_one_of_their_words() -> None:
    passages = prose_passages(1000)
    assert len(passages) >= 4
    for passage in passages:
        assert "```" not in passage and not passage.startswith(("#", "|", "-"))
    text = str(quote_prompt(0, 1000)[0]["content"])
    word = text.split("What does the text say about ")[1].split("?")[0]
    assert passages[0] in text and word in passages[0].lower()


def test_repetition_tells_copies_of_the_prompt_from_the_output_repeating_itself() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7]
    # 4, 5, 6 end the prompt's 4-grams; the last 3 ends [0, 1, 2, 3], which the output had before
    assert repetition(prompt, [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]) == (3, 1)
    assert repetition([1, 2, 3], [7, 8, 9, 7, 8, 9, 7, 8, 9]) == (0, 3)  # a loop of 3 tokens
    assert repetition(prompt, [8, 9, 10, 11]) == (0, 0)


def test_acceptance_is_the_difference_of_the_speculators_totals() -> None:
    before = SpecDecodingStats(10, 30, 20, [9, 7, 4])
    after = SpecDecodingStats(14, 42, 29, [13, 10, 6])
    acc = Acceptance.between(before, after)
    assert acc == Acceptance(4, 12, 9, [4, 3, 2])
    assert acc.rate == 0.75 and acc.mean_length == 1 + 9 / 4
    assert Acceptance(0, 0, 0, [0, 0, 0]).mean_length == 1.0


def test_the_report_gives_each_ratio_against_its_target() -> None:
    settings = {"num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    args = argparse.Namespace(model="m", num_threads=2, max_tokens=9, disable_by_batch_size=4, **settings)
    machine = {"cpu": "cpu", "cores": 2, "memory_gib": 8, "foreign_load_cores": 0.0}
    acceptance = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 9, "rate": 0.75}
    row = {
        "name": "rewrite a file",
        "prompts": 2,
        "output_tokens": 100,
        "from_prompt": 0.8,
        "self_repeated": 0.05,
        "tok_per_s": {"without": 50.0, "with": 90.0},
        "ratio": 1.8,
        "target": 1.6,
        "acceptance": {**acceptance, "num_accepted_tokens_per_pos": [4, 3, 2], "mean_length": 3.25},
        "differing": [1],
    }
    lines = markdown(args, machine, [row, {**row, "name": "open", "ratio": 0.9, "target": 0.97}]).splitlines()
    assert lines[0].startswith("Machine: cpu, 2 cores, 2 engine threads")
    assert "num_speculative_tokens=3" in lines[0] and "steps of more than 4 running requests" in lines[0]
    cells = [c.strip() for c in lines[-2].strip("|").split("|")]
    assert cells == [
        "rewrite a file", "2", "100", "80% / 5%", "50.0", "90.0", "1.80x", ">= 1.6x (meets)", "0.75",
        "3.25", "1.00, 0.75, 0.50", "4 (12 tokens)", "1/2",
    ]  # fmt: skip
    assert "0.90x | >= 0.97x (misses)" in lines[-1]


def test_a_short_run_compares_both_engines_on_every_workload(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    command = [sys.executable, "-m", "benchmarks.spec_decode", "--quick", "--num-prompts", "1"]
    command += ["--max-tokens", "16", "--num-streams", "9", "--file-chars", "800", "--passage-chars", "400"]
    command += ["--num-threads", "1", "--json", str(out)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "greedy token ids identical with and without speculation: 12/12 prompts" in proc.stdout
    results = json.loads(out.read_text())["results"]
    rows = {r["name"]: r for r in results["workloads"]}
    assert list(rows) == ["rewrite a file", "quote a passage", "open prompts", "9 streams at once"]
    assert results["identical"] and all(r["differing"] == [] for r in rows.values())
    rewrite = rows["rewrite a file"]
    assert rewrite["acceptance"]["num_accepted_tokens"] > 0 and rewrite["from_prompt"] > 0
    assert all(r["tok_per_s"]["without"] > 0 and r["tok_per_s"]["with"] > 0 for r in rows.values())
