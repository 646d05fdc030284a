"""Speculative decoding (n-gram prompt lookup, issue 20): the same engine settings with and without
`speculative_config={"method": "ngram", ...}`, one engine after the other in one run, on four workloads:

    .venv/bin/python -m benchmarks.spec_decode                   # the issue's measurement
    .venv/bin/python -m benchmarks.spec_decode --quick           # a smoke test: few prompts, short outputs
    .venv/bin/python -m benchmarks.spec_decode --num-speculative-tokens 4 --prompt-lookup-max 3

- rewrite (single stream): a source file of this repository (llmserve/scheduling/*.py from its first
  definition, cut to --file-chars at a line end) and a request to rewrite the whole file with one
  name changed;
- quote (single stream): a passage of prose from docs/*.md (about --passage-chars) and a question
  about one of its frequent words, to be answered with verbatim quotes;
- open (single stream): short open prompts whose greedy answers end by themselves without repeating
  themselves or the prompt (chosen so for SmolLM2: a small model loops under greedy decoding when let
  run); the acceptance stats show how little there was to guess;
- --num-streams requests (64) submitted at once through `LLM.chat`, the three kinds in turn.

The workloads are built from the repository's files as they are when it runs. How input-grounded each
workload's outputs were is printed beside its rate: the share of output tokens that end a 4-gram of
the prompt, and of those that end one only the output itself had before (a small model's greedy
output also loops, which prompt lookup guesses as well).

Every request is a chat, greedy, at most --max-tokens. A single stream's rate is decode only: the
tokens after its first over the time from its first token to its last (`RequestOutput.metrics`), summed
over the workload's prompts one at a time. The concurrent workload's rate is its output tokens over the
whole `LLM.chat` call, after a max_tokens=1 pass over the same prompts has filled the prefix cache, so
that (nearly) no prefill is timed: speculation changes decoding only, and a prefill in both figures
would pull their ratio towards 1. Targets (issue 20): >= 1.6x on rewrite and quote, >= 0.97x on open
and on the concurrent workload.

Both engines run in this process (`multiprocess=False`, the same for both), alive together and taking
turns (single prompts alternate which engine goes first; the concurrent batch runs without, with, with,
without), so that drift in a shared machine's speed meets both alike. The process is where the
scheduler's speculator keeps its cumulative counts (vLLM's: drafts, draft tokens, accepted tokens, per
position); each workload reports their difference across it: the acceptance rate (accepted / draft
tokens) and the mean acceptance length (vLLM's: 1 + accepted tokens per drafted step, the tokens a
drafted step yields). Speculation is exact for greedy sampling, so the script checks that every prompt's
token ids are identical with and without it, prints the outcome, and exits with an error if any differ.
"""

from __future__ import annotations

import argparse
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.machine import describe, warn_if_busy
from benchmarks.common.peers import engine_threads
from benchmarks.common.results import add_json_arg, write_results
from llmserve import LLM, RequestOutput, SamplingParams
from llmserve.config import SpeculativeConfig
from llmserve.contracts import SpecDecodingStats
from llmserve.engine.core_client import InprocClient
from llmserve.engine.input_processor import ChatMessage

REPO = Path(__file__).resolve().parent.parent
CODE_FILES = "llmserve/scheduling/*.py"
PROSE_FILES = "docs/*.md"
RENAME_PREFIXES = ("Paged", "Shared", "Local", "Cached")
# Open prompts that SmolLM2-135M-Instruct answers, greedily, in 25-100 tokens that end by themselves
# and do not loop (checked by the few drafts they yield); longer open answers of a small model loop.
OPEN_PROMPTS = (
    "Describe a walk through a busy night market in a few sentences.",
    "In a few sentences, describe an old library at midnight.",
    "Describe an imaginary city floating in the clouds in three sentences.",
    "In a few sentences, describe the view from the top of a volcano.",
    "Describe the first morning of spring in a small village, in a few sentences.",
    "Describe a street musician playing in the rain, in a few sentences.",
    "In a few sentences, describe a harbor at dawn.",
    "In a few sentences, describe a train journey through snowy forests.",
)
Conversation = list[ChatMessage]


def line_cut(text: str, chars: int) -> str:
    """`text` up to its last line end within `chars` characters."""
    return text if len(text) <= chars else text[: text.rfind("\n", 0, chars) + 1]


def rewrite_prompt(i: int, file_chars: int) -> Conversation:
    """The i-th file in turn, from its first definition (a small model given the imports first tends
    to loop on them); each round over the files renames another of its names."""
    files = sorted(p for p in REPO.glob(CODE_FILES) if p.name != "__init__.py")
    path, variant = files[i % len(files)], i // len(files)
    text = path.read_text()
    first = re.search(r"^(?:@.*\n)*(?:class|def) ", text, re.MULTILINE)
    code = line_cut(text[first.start() if first else 0 :], file_chars)
    names = re.findall(r"^(?:class|def) (\w+)", code, re.MULTILINE)
    old, prefix = names[variant % len(names)], RENAME_PREFIXES[variant % len(RENAME_PREFIXES)]
    new = prefix + old if old[0].isupper() else f"{prefix.lower()}_{old}"
    request = (
        f"Rewrite the whole file, renaming `{old}` to `{new}` everywhere and changing nothing else. "
        "Output only the code."
    )
    return [{"role": "user", "content": f"Here is a Python file:\n\n```python\n{code}```\n\n{request}"}]


def prose_passages(passage_chars: int) -> list[str]:
    """Runs of consecutive prose paragraphs of docs/*.md (no headings, lists, tables or code), each
    of about `passage_chars` characters."""
    passages: list[str] = []
    for path in sorted(REPO.glob(PROSE_FILES)):
        current: list[str] = []
        fenced = False
        for block in re.split(r"\n\s*\n", path.read_text()):
            text = block.strip()
            if text.count("```") % 2:
                fenced = not fenced
            if fenced or "```" in text or not text or text[0] in "#|-*>`<!" or block.startswith("    "):
                continue
            current.append(" ".join(text.split()))
            if sum(map(len, current)) >= passage_chars:
                passages.append("\n\n".join(current))
                current = []
        if current:
            passages.append("\n\n".join(current))
    return passages


def key_terms(passage: str) -> list[str]:
    """The passage's long words, the most frequent first: what a question about it would name (not the
    project's own name, which every passage is about)."""
    words = Counter(w.lower() for w in re.findall(r"\b[a-zA-Z]{7,}\b", passage))
    return [w for w, _ in words.most_common() if w != "llmserve"]


def quote_prompt(i: int, passage_chars: int) -> Conversation:
    """The i-th passage in turn; each round over the passages asks about another of its words."""
    passages = prose_passages(passage_chars)
    passage, variant = passages[i % len(passages)], i // len(passages)
    terms = key_terms(passage)
    question = f"What does the text say about {terms[variant % len(terms)]}?"
    request = f"Question: {question} Answer with verbatim quotes of its sentences."
    return [{"role": "user", "content": f"Text:\n{passage}\n\n{request}"}]


def open_prompt(i: int) -> Conversation:
    return [{"role": "user", "content": OPEN_PROMPTS[i % len(OPEN_PROMPTS)]}]


@dataclass(frozen=True)
class Workload:
    name: str
    conversations: list[Conversation]
    concurrent: bool  # all submitted at once (else one at a time)
    target: float  # with / without speculation, output tokens/s


def workloads(args: argparse.Namespace) -> list[Workload]:
    n, streams = args.num_prompts, args.num_streams
    makers = (
        lambda i: rewrite_prompt(i, args.file_chars),
        lambda i: quote_prompt(i, args.passage_chars),
        open_prompt,
    )
    mixed = [makers[i % 3](i // 3) for i in range(streams)]
    return [
        Workload("rewrite a file", [rewrite_prompt(i, args.file_chars) for i in range(n)], False, 1.6),
        Workload("quote a passage", [quote_prompt(i, args.passage_chars) for i in range(n)], False, 1.6),
        Workload("open prompts", [open_prompt(i) for i in range(n)], False, 0.97),
        Workload(f"{streams} streams at once", mixed, True, 0.97),
    ]


@dataclass(frozen=True)
class Acceptance:
    """Speculation's counts over one workload (vLLM's names)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]

    @classmethod
    def between(cls, before: SpecDecodingStats, after: SpecDecodingStats, runs: int = 1) -> Acceptance:
        """The counts from `before` to `after`, per run of the workload."""
        per_pos = [
            (b - a) // runs
            for a, b in zip(before.num_accepted_tokens_per_pos, after.num_accepted_tokens_per_pos)
        ]
        return cls(
            (after.num_drafts - before.num_drafts) // runs,
            (after.num_draft_tokens - before.num_draft_tokens) // runs,
            (after.num_accepted_tokens - before.num_accepted_tokens) // runs,
            per_pos,
        )

    @property
    def rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass(frozen=True)
class Run:
    """One engine's pass over one workload."""

    prompt_ids: list[list[int]]  # per prompt
    token_ids: list[list[int]]  # per prompt
    timed_tokens: int
    seconds: float
    acceptance: Acceptance | None  # None without speculation

    @property
    def tok_per_s(self) -> float:
        return self.timed_tokens / self.seconds


def speculator_stats(llm: LLM) -> SpecDecodingStats | None:
    client = llm.llm_engine.engine_core
    assert isinstance(client, InprocClient)  # multiprocess=False
    speculator = client.engine_core.scheduler.speculator
    return None if speculator is None else speculator.snapshot()


def decode_timing(output: RequestOutput) -> tuple[int, float]:
    """Tokens after the first, and the seconds from the first token to the last."""
    m = output.metrics
    assert m is not None and m.first_token_time is not None and m.last_token_time is not None
    return len(output.outputs[0].token_ids) - 1, m.last_token_time - m.first_token_time


def run_workload(engines: dict[bool, LLM], work: Workload, params: SamplingParams) -> dict[bool, Run]:
    """Both engines over the workload, taking turns so that drift in the machine's speed meets both
    alike: single prompts alternate which engine goes first; the concurrent batch runs without, with,
    with, without, and each engine's figure is its two runs together."""
    before = speculator_stats(engines[True])
    outputs: dict[bool, list[RequestOutput]] = {False: [], True: []}
    tokens, seconds = {False: 0, True: 0}, {False: 0.0, True: 0.0}
    if work.concurrent:
        for speculative in (False, True, True, False):
            llm = engines[speculative]
            llm.chat(
                work.conversations, SamplingParams(max_tokens=1), use_tqdm=False
            )  # fills the prefix cache
            start = time.perf_counter()
            batch = llm.chat(work.conversations, params, use_tqdm=False)
            seconds[speculative] += time.perf_counter() - start
            tokens[speculative] += sum(len(o.outputs[0].token_ids) for o in batch)
            outputs[speculative] = batch
    else:
        for i, conversation in enumerate(work.conversations):
            for speculative in (False, True) if i % 2 == 0 else (True, False):
                output = engines[speculative].chat(conversation, params, use_tqdm=False)[0]
                n, s = decode_timing(output)
                tokens[speculative] += n
                seconds[speculative] += s
                outputs[speculative].append(output)
    after = speculator_stats(engines[True])
    assert before is not None and after is not None
    # in the concurrent workload the speculating engine ran twice: its counts are per run
    acceptance = Acceptance.between(before, after, runs=2 if work.concurrent else 1)
    return {
        speculative: Run(
            [o.prompt_token_ids for o in outputs[speculative]],
            [list(o.outputs[0].token_ids) for o in outputs[speculative]],
            tokens[speculative],
            seconds[speculative],
            acceptance if speculative else None,
        )
        for speculative in (False, True)
    }


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    config = SpeculativeConfig.parse(
        {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
            "disable_by_batch_size": args.disable_by_batch_size,
        }
    )
    assert config is not None
    return config


def make_engine(args: argparse.Namespace, speculative: bool) -> LLM:
    spec = {k: v for k, v in asdict(speculative_config(args)).items() if v is not None}
    llm = LLM(
        model=args.model,
        num_threads=args.num_threads,
        max_num_seqs=max(args.num_streams, 1),
        kv_cache_memory=args.kv_cache_memory,
        multiprocess=False,
        speculative_config=spec if speculative else None,
    )
    # the first steps of a long prompt and, with speculation, of several rows per sequence
    llm.chat(rewrite_prompt(0, args.file_chars), SamplingParams(max_tokens=16), use_tqdm=False)
    return llm


def run_engines(args: argparse.Namespace, works: list[Workload]) -> list[dict[bool, Run]]:
    """Both engines, alive together, over every workload."""
    engines = {speculative: make_engine(args, speculative) for speculative in (False, True)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    runs = []
    try:
        for work in works:
            runs.append(run_workload(engines, work, params))
            without, with_ = runs[-1][False].tok_per_s, runs[-1][True].tok_per_s
            print(
                f"{work.name}: {without:.1f} output tok/s without speculation, {with_:.1f} with", flush=True
            )
    finally:
        for llm in engines.values():
            llm.shutdown()
    return runs


def repetition(prompt: list[int], output: list[int], n: int = 4) -> tuple[int, int]:
    """Of the output's tokens, how many end an n-gram that occurs in the prompt, and how many one that
    occurs only earlier in the output (the n-grams may begin in the prompt): what prompt lookup could
    guess from the input, and what it could guess from the output repeating itself."""
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    text, seen, copied, repeated = prompt + output, set[tuple[int, ...]](), 0, 0
    for end in range(len(prompt) + 1, len(text) + 1):
        gram = tuple(text[max(end - n, 0) : end])
        copied += gram in grams
        repeated += gram not in grams and gram in seen
        seen.add(gram)
    return copied, repeated


def compare(work: Workload, without: Run, with_: Run) -> dict[str, Any]:
    """One workload's figures for the report and the results file."""
    acc = with_.acceptance
    assert acc is not None
    counts = [repetition(p, o) for p, o in zip(with_.prompt_ids, with_.token_ids)]
    output_tokens = sum(map(len, with_.token_ids))
    return {
        "name": work.name,
        "prompts": len(work.conversations),
        "concurrent": work.concurrent,
        "output_tokens": output_tokens,
        "from_prompt": sum(c for c, _ in counts) / max(output_tokens, 1),
        "self_repeated": sum(r for _, r in counts) / max(output_tokens, 1),
        "tok_per_s": {"without": without.tok_per_s, "with": with_.tok_per_s},
        "ratio": with_.tok_per_s / without.tok_per_s,
        "target": work.target,
        "acceptance": {**asdict(acc), "rate": acc.rate, "mean_length": acc.mean_length},
        "differing": [i for i, (a, b) in enumerate(zip(without.token_ids, with_.token_ids)) if a != b],
    }


COLUMNS = (
    "workload",
    "prompts",
    "output tokens",
    "output 4-grams from prompt / repeated",
    "tok/s without",
    "tok/s with",
    "with/without",
    "target",
    "acceptance rate",
    "mean acceptance length",
    "accepted per position",
    "drafts",
    "identical outputs",
)


def markdown(args: argparse.Namespace, machine: dict[str, object], rows: list[dict[str, Any]]) -> str:
    """The machine and settings, then a table row per workload."""
    m = machine
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {args.num_threads} engine threads, {m['memory_gib']} "
        f"GiB; other work at the start: {m['foreign_load_cores']} cores. Model: {args.model}; ngram, "
        f"num_speculative_tokens={args.num_speculative_tokens}, prompt_lookup_min={args.prompt_lookup_min},"
        f" prompt_lookup_max={args.prompt_lookup_max}, no guesses in steps of more than "
        f"{speculative_config(args).speculating_batch_size} running requests; greedy, "
        f"max_tokens={args.max_tokens}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---" * len(COLUMNS) + "|",
    ]
    for r in rows:
        acc, rates = r["acceptance"], r["tok_per_s"]
        drafts = acc["num_drafts"]
        per_pos = (
            ", ".join(f"{n / drafts:.2f}" for n in acc["num_accepted_tokens_per_pos"]) if drafts else "-"
        )
        verdict = "meets" if r["ratio"] >= r["target"] else "misses"
        cells = [
            r["name"],
            r["prompts"],
            r["output_tokens"],
            f"{r['from_prompt']:.0%} / {r['self_repeated']:.0%}",
            f"{rates['without']:.1f}",
            f"{rates['with']:.1f}",
            f"{r['ratio']:.2f}x",
            f">= {r['target']}x ({verdict})",
            f"{acc['rate']:.2f}",
            f"{acc['mean_length']:.2f}",
            per_pos,
            f"{drafts} ({acc['num_draft_tokens']} tokens)",
            f"{r['prompts'] - len(r['differing'])}/{r['prompts']}",
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--prompt-lookup-min", type=int, default=3)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument(
        "--disable-by-batch-size", type=int, default=None, help="speculative_config's (default: the engine's)"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="per request (default 256; --quick 32)")
    parser.add_argument("--num-threads", type=int, default=None, help="the engine's (default: every core)")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="per single-stream workload (4; --quick 2)"
    )
    parser.add_argument("--num-streams", type=int, default=None, help="requests at once (64; --quick 12)")
    parser.add_argument(
        "--kv-cache-memory", type=int, default=3 << 30, help="bytes, each engine's (both are alive at once)"
    )
    parser.add_argument("--file-chars", type=int, default=2000, help="of each source file to rewrite")
    parser.add_argument("--passage-chars", type=int, default=1000, help="of each passage to quote from")
    parser.add_argument("--quick", action="store_true", help="a smoke test: few prompts, short outputs")
    add_json_arg(parser)
    args = parser.parse_args()
    quick = args.quick
    args.max_tokens = args.max_tokens or (32 if quick else 256)
    args.num_prompts = args.num_prompts or (2 if quick else 4)
    args.num_streams = args.num_streams or (12 if quick else 64)
    args.num_threads = args.num_threads or engine_threads()
    return args


def main() -> None:
    args = parse_args()
    load = warn_if_busy()
    works = workloads(args)
    rows = [compare(work, runs[False], runs[True]) for work, runs in zip(works, run_engines(args, works))]
    print("\n" + markdown(args, describe(load), rows))
    differ = [f"{r['name']} #{i}" for r in rows for i in r["differing"]]
    total = sum(r["prompts"] for r in rows)
    print(
        f"\ngreedy token ids identical with and without speculation: {total - len(differ)}/{total} prompts"
        + (f"; they differ for {', '.join(differ)}" if differ else "")
    )
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    results = {"model": args.model, "settings": settings, "workloads": rows, "identical": not differ}
    write_results(args.json, "benchmarks.spec_decode", results, load)
    if differ:
        raise SystemExit("speculative decoding changed greedy outputs: see above.")


if __name__ == "__main__":
    main()
