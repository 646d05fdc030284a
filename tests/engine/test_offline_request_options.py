"""vLLM's request options on the offline path (`LLM`, `InputProcessor`), on the tiny random Llama:
`truncate_prompt_tokens`, `add_special_tokens`, `continue_final_message`, `chat_template_kwargs`; and
the limits the server answers with a 400 (the context length, `n`), raised here as `ValueError`s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from llmserve import LLM, SamplingParams
from llmserve.config import ResolvedLimits
from llmserve.engine.input_processor import ChatMessage, InputProcessor, TokensPrompt
from llmserve.sampling_params import MAX_N
from tests.engine.test_llm_batching import assert_no_leaks, make_llm, random_prompts
from tests.fixtures.tiny_llama import BOS_ID, CHAT_TEMPLATE, VOCAB_SIZE, build_tokenizer

MAX_MODEL_LEN = 256
CHAT: list[ChatMessage] = [
    {"role": "user", "content": "the weather"},
    {"role": "assistant", "content": "It is warm and"},
]


@pytest.fixture(scope="module")
def llm(tiny_llama_hf_dir: Path) -> Iterator[LLM]:
    engine = make_llm(tiny_llama_hf_dir, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.shutdown()


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


def test_prompt_plus_max_tokens_past_the_context_raises_as_the_server_does(llm: LLM) -> None:
    prompt = TokensPrompt(prompt_token_ids=random_prompts(1, 200, 200, seed=1)[0]["prompt_token_ids"])
    with pytest.raises(ValueError) as error:
        llm.generate(prompt, greedy(MAX_MODEL_LEN - 199), use_tqdm=False)
    assert str(error.value).startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens.")
    assert "(200 in the messages, 57 in the completion)" in str(error.value)
    assert_no_leaks(llm)
    out = llm.generate(prompt, greedy(MAX_MODEL_LEN - 200), use_tqdm=False)[0].outputs[0]
    assert (len(out.token_ids), out.finish_reason) == (MAX_MODEL_LEN - 200, "length")


def test_n_is_capped_as_the_server_caps_it(llm: LLM) -> None:
    with pytest.raises(ValueError, match=rf"^n must be an integer from 1 to {MAX_N}"):
        llm.generate("hi", SamplingParams(n=MAX_N + 1), use_tqdm=False)
    SamplingParams(n=MAX_N)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    ids = random_prompts(1, 300, 300, seed=2)[0]["prompt_token_ids"]
    params = greedy(8, truncate_prompt_tokens=40)
    truncated = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    sliced = llm.generate({"prompt_token_ids": ids[-40:]}, greedy(8), use_tqdm=False)[0]
    assert truncated.prompt_token_ids == ids[-40:]
    assert truncated.outputs[0].token_ids == sliced.outputs[0].token_ids
    # -1 keeps max_model_len tokens: room for nothing, so the prompt is refused as too long
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": ids}, greedy(1, truncate_prompt_tokens=-1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens \(257\) cannot be greater than max_model"):
        llm.generate("hi", greedy(1, truncate_prompt_tokens=MAX_MODEL_LEN + 1), use_tqdm=False)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="^truncate_prompt_tokens must be"):
            SamplingParams(truncate_prompt_tokens=bad)
    assert_no_leaks(llm)


def test_truncation_applies_to_text_and_chat_prompts(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    text = "the weather in the north is warm and wet, and there are storms at night"
    out = llm.generate(text, greedy(2, truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert out.prompt_token_ids == tokenizer.encode(text)[-5:]
    chat = llm.chat(CHAT[:1], greedy(2, truncate_prompt_tokens=3), use_tqdm=False)[0]
    rendered = llm.llm_engine.input_processor.render_chat(CHAT[:1])["prompt_token_ids"]
    assert chat.prompt_token_ids == rendered[-3:]


def test_continue_final_message_leaves_the_assistant_message_open(llm: LLM) -> None:
    processor = llm.llm_engine.input_processor
    text = processor.render_chat_text(CHAT, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|im_start|>user\nthe weather<|im_end|>\n<|im_start|>assistant\nIt is warm and"
    closed = processor.render_chat_text(CHAT, add_generation_prompt=False)
    assert closed == text + "<|im_end|>\n"
    out = llm.chat(CHAT, greedy(4), use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert out[0].prompt_token_ids == llm.get_tokenizer().encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="^continue_final_message and add_generation_prompt cannot both"):
        llm.chat(CHAT, greedy(4), use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="^continue_final_message .* must be the assistant's; got 'user'"):
        llm.chat(CHAT[:1], greedy(4), add_generation_prompt=False, continue_final_message=True)
    assert_no_leaks(llm)


def test_chat_template_kwargs_are_template_variables(llm: LLM) -> None:
    template = "{{ greeting | default('none') }}|" + CHAT_TEMPLATE
    processor = llm.llm_engine.input_processor
    plain = processor.render_chat_text(CHAT[:1], template)
    assert plain.startswith("none|")
    greeted = processor.render_chat_text(CHAT[:1], template, chat_template_kwargs={"greeting": "hello"})
    assert greeted == "hello|" + plain.removeprefix("none|")
    out = llm.chat(CHAT[:1], greedy(1), chat_template=template, chat_template_kwargs={"greeting": "x"})
    assert out[0].prompt_token_ids[:2] == llm.get_tokenizer().encode("x|", add_special_tokens=False)
    documents = "{% for d in documents %}[{{ d.title }}]{% endfor %}" + CHAT_TEMPLATE
    rag = processor.render_chat_text(
        CHAT[:1], documents, chat_template_kwargs={"documents": [{"title": "x"}]}
    )
    assert rag.startswith("[x]<|im_start|>user")
    for taken in ("add_generation_prompt", "tokenize", "chat_template", "return_dict", "conversation"):
        with pytest.raises(ValueError, match=f"^chat_template_kwargs must not set {taken}"):
            processor.render_chat_text(CHAT[:1], chat_template_kwargs={taken: False})


@pytest.fixture(scope="module")
def bos_processor() -> InputProcessor:
    """The tiny Llama's tokenizer with a post-processor that adds a BOS, as Llama's does."""
    backend = build_tokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", BOS_ID)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    limits = ResolvedLimits(max_model_len=64, num_kv_blocks=8, block_size=16, vocab_size=VOCAB_SIZE)
    return InputProcessor(tokenizer, limits, eos_token_ids=[2])


def test_add_special_tokens_adds_the_tokenizers_bos(bos_processor: InputProcessor) -> None:
    params = SamplingParams()
    with_bos, _ = bos_processor.process_inputs("a", "the weather", params)
    without, _ = bos_processor.process_inputs("b", "the weather", params, add_special_tokens=False)
    assert with_bos.prompt_token_ids == [BOS_ID, *without.prompt_token_ids]
    # a chat template writes its own special tokens: none are added unless asked (vLLM's default)
    chat = bos_processor.render_chat(CHAT[:1])["prompt_token_ids"]
    assert chat[0] == BOS_ID and chat[1] != BOS_ID  # the template's <|im_start|>
    assert bos_processor.render_chat(CHAT[:1], add_special_tokens=True)["prompt_token_ids"] == [BOS_ID, *chat]
    # left truncation keeps the end: the BOS goes first
    truncated, _ = bos_processor.process_inputs("c", "the weather", SamplingParams(truncate_prompt_tokens=2))
    assert truncated.prompt_token_ids == with_bos.prompt_token_ids[-2:]


def test_chat_passes_tools_to_the_template(llm: LLM) -> None:
    template = "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = llm.chat(CHAT[:1], greedy(1), use_tqdm=False, chat_template=template, tools=tools)[0]
    without = llm.chat(CHAT[:1], greedy(1), use_tqdm=False, chat_template=template)[0]
    decode = llm.get_tokenizer().decode
    assert decode(with_tools.prompt_token_ids) == "[tool get_weather]the weather"
    assert decode(without.prompt_token_ids) == "the weather"
