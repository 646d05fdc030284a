"""Random sampling with speculation keeps the model's distribution: the joint distribution of the three
tokens sampled after the first (the step after the prompt guesses all three), over a four-token
vocabulary (allowed_token_ids), is the same with guesses checked by rejection sampling as without
(two-sample chi-square), and guesses were both kept and rejected at every position."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from llmserve import LLM, SamplingParams

ALLOWED = [67, 68, 69, 70]
PROMPT = [67, 68, 69, 70, 68, 67, 70, 69] * 3  # every token recurs: n-gram lookup always guesses
SAMPLES = 2000
# chi-square critical value for 63 degrees of freedom (4 ** 3 cells - 1) at p = 0.001
CRITICAL_DF63 = 103.4


def sampled_triples(model: Path, speculative: bool) -> tuple[Counter[tuple[int, ...]], object]:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(
        str(model),
        multiprocess=False,
        max_num_seqs=256,
        speculative_config={**spec, "disable_by_batch_size": 256} if speculative else None,
    )
    try:
        params = [
            SamplingParams(max_tokens=5, temperature=1.0, allowed_token_ids=ALLOWED, seed=i, ignore_eos=True)
            for i in range(SAMPLES)
        ]
        outputs = llm.generate([{"prompt_token_ids": PROMPT}] * SAMPLES, params, use_tqdm=False)
        stats = llm.llm_engine.engine_core.engine_core.scheduler.make_stats().spec_decoding  # type: ignore[attr-defined]
    finally:
        llm.shutdown()
    return Counter(tuple(o.outputs[0].token_ids[1:4]) for o in outputs), stats


def test_sampled_sequences_keep_their_distribution(tiny_llama_hf_dir: Path) -> None:
    plain, _ = sampled_triples(tiny_llama_hf_dir, speculative=False)
    speculated, stats = sampled_triples(tiny_llama_hf_dir, speculative=True)
    assert stats is not None
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # guesses kept and rejected
    assert all(0 < accepted < stats.num_drafts for accepted in stats.num_accepted_tokens_per_pos)
    cells = set(plain) | set(speculated)
    chi2 = sum((plain[c] - speculated[c]) ** 2 / (plain[c] + speculated[c]) for c in cells)
    assert chi2 < CRITICAL_DF63, (chi2, plain.most_common(5), speculated.most_common(5))
