"""Output processing on the real model: stop strings, stop tokens, EOS, lengths, chat."""

from __future__ import annotations

from llmserve import LLM, SamplingParams
from llmserve.engine.input_processor import ChatMessage

PROMPT = "The capital of France is"  # greedy: " Paris.\n\n..."


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)  # type: ignore[arg-type]


def test_stop_string_truncates_and_can_be_included(llm: LLM) -> None:
    out = llm.generate(PROMPT, greedy(max_tokens=16, stop=["."]), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" Paris", "stop", ".")
    out = llm.generate(
        PROMPT, greedy(max_tokens=16, stop="s.", include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" Paris.", "stop", "s.")


def test_stop_token_id_ends_the_request(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy(max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[2]
    out = llm.generate(PROMPT, greedy(max_tokens=8, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.token_ids == full.token_ids[: full.token_ids.index(stop_id) + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_id)


def test_eos_stops_unless_ignored_and_special_tokens_can_show(llm: LLM) -> None:
    chat: list[ChatMessage] = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    eos = llm.generate(
        {"prompt_token_ids": llm.llm_engine.input_processor.render_chat(chat)["prompt_token_ids"]},
        greedy(max_tokens=48),
        use_tqdm=False,
    )[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.stop_reason is None
    assert eos.token_ids[-1] == llm.get_tokenizer().eos_token_id
    assert "<|im_end|>" not in eos.text
    shown = llm.chat(chat, greedy(max_tokens=48, skip_special_tokens=False), use_tqdm=False)[0]
    assert shown.outputs[0].text.endswith("<|im_end|>")
    ignored = llm.chat(chat, greedy(max_tokens=48, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert (len(ignored.token_ids), ignored.finish_reason) == (48, "length")


def test_chat_accepts_a_list_of_conversations(llm: LLM) -> None:
    conversations: list[list[ChatMessage]] = [
        [{"role": "user", "content": "Say hello."}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    ]
    outputs = llm.chat(conversations, greedy(max_tokens=8), use_tqdm=False)
    assert len(outputs) == 2 and all(o.outputs[0].text for o in outputs)
    assert (
        outputs[0].outputs[0].text
        == llm.chat(conversations[0], greedy(max_tokens=8), use_tqdm=False)[0].outputs[0].text
    )
