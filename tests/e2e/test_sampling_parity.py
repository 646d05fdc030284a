"""Issue 5 on the real model: min_tokens against a chat answer that stops early, and prompt logprobs
scoring a continuation exactly as Hugging Face does (lm-evaluation-harness' log-likelihood)."""

from __future__ import annotations

from typing import Any, cast

import torch

from llmserve import LLM, SamplingParams
from llmserve.engine.input_processor import ChatMessage, TokensPrompt
from llmserve.outputs import Logprob


def test_min_tokens_keeps_a_short_chat_answer_going(llm: LLM) -> None:
    chat: list[ChatMessage] = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    prompt: TokensPrompt = {
        "prompt_token_ids": llm.llm_engine.input_processor.render_chat(chat)["prompt_token_ids"]
    }
    short = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert short.outputs[0].finish_reason == "stop" and len(short.outputs[0].token_ids) < 20
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20)
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    processor = llm.llm_engine.input_processor
    stops = {processor.eos_token_id, *processor.extra_eos_ids}
    assert len(out.token_ids) >= 20 and not stops & set(out.token_ids[:20])


def test_prompt_logprobs_sum_to_the_hf_log_likelihood(llm: LLM, hf_model: Any) -> None:
    tokenizer = llm.get_tokenizer()
    context = tokenizer.encode("The capital of France is")
    continuation = tokenizer.encode(" Paris, and the capital of Italy is Rome.", add_special_tokens=False)
    ids = context + continuation
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    scored = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].prompt_logprobs
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    # every position past the first (None, asserted above) is scored
    ours = sum(cast(dict[int, Logprob], scored[i])[ids[i]].logprob for i in range(len(context), len(ids)))
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    theirs = sum(reference[i - 1, ids[i]].item() for i in range(len(context), len(ids)))
    assert abs(ours - theirs) < 1e-3
