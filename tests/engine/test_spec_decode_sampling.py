"""Random sampling with speculation keeps the model's distribution, over a four-token vocabulary
(allowed_token_ids) where n-gram lookup always guesses: the three tokens sampled after the first (the
step after the prompt guesses all three) are distributed alike with and without guesses (two-sample
chi-square over unseeded requests), a seeded request samples exactly the same tokens, and guesses were
both kept and rejected at every position."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from llmserve import LLM, SamplingParams
from llmserve.contracts import SpecDecodingStats

ALLOWED = [67, 68, 69, 70]
PROMPT = [67, 68, 69, 70, 68, 67, 70, 69] * 3  # every token recurs: n-gram lookup always guesses
UNSEEDED, SEEDED = 1500, 200
# chi-square critical value for 63 degrees of freedom (4 ** 3 cells - 1) at p = 0.001
CRITICAL_DF63 = 103.4


def sample(model: Path, speculative: bool) -> tuple[list[list[int]], SpecDecodingStats | None]:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(
        str(model),
        multiprocess=False,
        max_num_seqs=256,
        speculative_config={**spec, "disable_by_batch_size": 256} if speculative else None,
    )
    seeds = [None] * UNSEEDED + list(range(SEEDED))
    params = [
        SamplingParams(max_tokens=5, temperature=1.0, allowed_token_ids=ALLOWED, seed=seed, ignore_eos=True)
        for seed in seeds
    ]
    try:
        outputs = llm.generate([{"prompt_token_ids": PROMPT}] * len(seeds), params, use_tqdm=False)
        stats = llm.llm_engine.engine_core.engine_core.scheduler.make_stats().spec_decoding  # type: ignore[attr-defined]
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs], stats


def test_sampled_sequences_keep_their_distribution(tiny_llama_hf_dir: Path) -> None:
    plain, _ = sample(tiny_llama_hf_dir, speculative=False)
    speculated, stats = sample(tiny_llama_hf_dir, speculative=True)
    assert stats is not None
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # guesses kept and rejected
    assert all(0 < accepted < stats.num_drafts for accepted in stats.num_accepted_tokens_per_pos)
    assert speculated[UNSEEDED:] == plain[UNSEEDED:]  # seeded: the same draws, the same tokens
    a = Counter(tuple(tokens[1:4]) for tokens in plain[:UNSEEDED])
    b = Counter(tuple(tokens[1:4]) for tokens in speculated[:UNSEEDED])
    chi2 = sum((a[c] - b[c]) ** 2 / (a[c] + b[c]) for c in set(a) | set(b))
    assert chi2 < CRITICAL_DF63, (chi2, a.most_common(5), b.most_common(5))
