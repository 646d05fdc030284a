"""The tokenizer we build from GGUF metadata must tokenize as transformers' own conversion does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from llmserve.model_executor.loader import load_tokenizer, resolve_model
from llmserve.model_executor.loader.tokenizer import eos_token_ids
from tests.fixtures.tiny_llama import CHAT_TEMPLATE, write_gguf

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14159, 1,000,000 -42 x2 2x",
    "def add(a, b):\n    return a + b  # sum\n\tprint(f'{a!r}')\n",
    "Café naïve résumé 你好，世界 Россия 😀👍🏽🇺🇸 ❤️",
    "   leading, trailing   \n\n\n\t\t mixed\r\n whitespace  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>llmserve<file_sep>x.py",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "",
    " ",
    "\u00a0nbsp\u200bzero-width",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.fixture(scope="module")
def ours(default_model_path: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(resolve_model(str(default_model_path)))


@pytest.fixture(scope="module")
def reference(default_model_path: Path) -> PreTrainedTokenizerBase:
    """transformers' own GGUF conversion: slow (~10 s), so built once."""
    return AutoTokenizer.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_default_model_tokenizes_like_transformers(
    text: str, ours: PreTrainedTokenizerBase, reference: PreTrainedTokenizerBase
) -> None:
    ids = ours(text).input_ids
    assert ids == reference(text).input_ids
    assert ours.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_default_model_digits_are_single_tokens(ours: PreTrainedTokenizerBase) -> None:
    assert ours.convert_ids_to_tokens(ours("12345").input_ids) == ["1", "2", "3", "4", "5"]


def test_default_model_special_tokens(
    ours: PreTrainedTokenizerBase, reference: PreTrainedTokenizerBase
) -> None:
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id"):
        assert getattr(ours, attr) == getattr(reference, attr), attr
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert len(ours) == len(reference) == 49152
    assert eos_token_ids(resolve_model("smollm2-135m-instruct"), ours) == [2]


@pytest.mark.parametrize("messages", [MESSAGES[1:2], MESSAGES])
def test_default_model_chat_template(
    messages: list[dict[str, str]], ours: PreTrainedTokenizerBase, reference: PreTrainedTokenizerBase
) -> None:
    text = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    assert text == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == reference.apply_chat_template(
        messages, add_generation_prompt=True
    )


def test_tiny_folder_and_gguf_tokenizers_agree(tiny_llama_hf_dir: Path, tiny_llama_gguf_path: Path) -> None:
    from_hf = load_tokenizer(resolve_model(str(tiny_llama_hf_dir)))
    from_gguf = load_tokenizer(resolve_model(str(tiny_llama_gguf_path)))
    assert from_hf.is_fast and from_gguf.is_fast
    for text in TEXTS:
        assert from_hf(text).input_ids == from_gguf(text).input_ids, text
        assert from_gguf.decode(from_gguf(text).input_ids) == text
    assert from_hf.chat_template == from_gguf.chat_template == CHAT_TEMPLATE
    assert eos_token_ids(resolve_model(str(tiny_llama_hf_dir)), from_hf) == [2]
    assert eos_token_ids(resolve_model(str(tiny_llama_gguf_path)), from_gguf) == [2]


def test_unknown_pre_tokenizer_falls_back_to_transformers(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "llama3-pre.gguf", tiny_llama_hf_dir, tokenizer_pre="llama-bpe")
    tokenizer = load_tokenizer(resolve_model(str(path)))
    text = "the weather is on 123 <|im_end|>"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer.eos_token == "<|im_end|>"


def test_chat_template_override(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    source = resolve_model(str(tiny_llama_hf_dir))
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert load_tokenizer(source, chat_template=template).chat_template == template

    template_file = tmp_path / "template.jinja"
    template_file.write_text(template)
    tokenizer = load_tokenizer(source, chat_template=str(template_file))
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered == "[user] hi\n"

    with pytest.raises(ValueError, match="neither a Jinja template nor an existing file"):
        load_tokenizer(source, chat_template=str(tmp_path / "missing.jinja"))


def test_eos_from_tokenizer_when_no_generation_config(tiny_llama_hf_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_llama_hf_dir, tmp_path / "no-gen-config")
    (folder / "generation_config.json").unlink()
    source = resolve_model(str(folder))
    assert eos_token_ids(source, load_tokenizer(source)) == [2]


def test_qwen2_vocabulary_tokenizes_like_transformers(qwen_gguf_path: Path) -> None:
    """Qwen2's split regex, built by us in a second where transformers takes ~17."""
    ours = load_tokenizer(resolve_model(str(qwen_gguf_path)))
    reference = AutoTokenizer.from_pretrained(str(qwen_gguf_path.parent), gguf_file=qwen_gguf_path.name)
    for text in [*TEXTS, "e\u0301 not composed", "x = [1,2,3]\n\n\n    return x**2  # 100%"]:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
    assert ours.apply_chat_template(MESSAGES, tokenize=False) == reference.apply_chat_template(
        MESSAGES, tokenize=False
    )
