"""Our tokenizers (from the GGUF's vocabulary, and from a saved HF folder) against
transformers' on varied text, the chat template, and streaming detokenization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest

from asynchicache.model.loader import LoadedModel
from asynchicache.model.tokenizer import GGUFVocab, Tokenizer

TEXTS = [
    "Hello, world!",
    "What is the capital of France?",
    "  leading spaces, trailing   ",
    "tabs\tand\nnewlines\n\n\nand    runs      of spaces",
    "Numbers: 1234567890, 3.14159, -42, 1e-9, 2026-11-29",
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, العربية, עברית",
    "CJK: 你好，世界！日本語のテキスト。한국어 텍스트",
    "Emoji: 😀🎉👍🏽 🇫🇷 👩‍👩‍👧‍👦 and a heart ❤️",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "special in the middle<|endoftext|>and after",
    "I'm sure they've said we'll do it, you'd think",
    "\u00a0non-breaking\u2009thin\u3000ideographic spaces",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


@pytest.fixture(scope="module")
def folder_tokenizer(hf_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_hf_folder(hf_tokenizer_dir)


@pytest.fixture(scope="module")
def hf_folder_reference(hf_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(
    smollm: LoadedModel, hf_gguf_tokenizer: Any, text: str
) -> None:
    ours = smollm.tokenizer.encode(text)
    assert ours == hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert smollm.tokenizer.decode(ours) == hf_gguf_tokenizer.decode(ours, skip_special_tokens=True)
    assert smollm.tokenizer.decode(ours, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", TEXTS)
def test_folder_tokenizer_matches_transformers(
    folder_tokenizer: Tokenizer, hf_folder_reference: Any, text: str
) -> None:
    ids = folder_tokenizer.encode(text)
    assert ids == hf_folder_reference.encode(text, add_special_tokens=False)
    assert folder_tokenizer.decode(ids) == hf_folder_reference.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_eos(smollm: LoadedModel, folder_tokenizer: Tokenizer) -> None:
    tok = smollm.tokenizer
    assert tok.eos_token_ids == (2,)
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, 9690, 2]) == "system"  # specials skipped
    assert 2 in folder_tokenizer.eos_token_ids
    assert tok.vocab_size == 49152


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    smollm: LoadedModel,
    folder_tokenizer: Tokenizer,
    hf_gguf_tokenizer: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    ref = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert smollm.tokenizer.apply_chat_template(messages, add_generation_prompt) == ref
    assert folder_tokenizer.apply_chat_template(messages, add_generation_prompt) == ref


RICH_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'system'] %}
        {{- raise_exception('bad role ' + message['role']) }}
    {%- endif %}
    {%- if loop.index0 > 5 %}{% break %}{% endif %}
    <{{ message['role'] }}>
    {% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}
    {%- endgeneration %}
    {% else %}{{ message['content'] | trim }}{% endif %}
    {{ message | tojson }}
{% endfor %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""


def test_rich_template_renders_like_transformers(
    hf_tokenizer_dir: Path, hf_folder_reference: Any
) -> None:
    tok = Tokenizer.from_hf_folder(hf_tokenizer_dir)
    tok = Tokenizer(
        tok.backend, type(tok.spec)(tok.spec.eos_token_ids, tok.spec.special, RICH_TEMPLATE)
    )
    messages = [*CONVERSATIONS[2], {"role": "assistant", "content": '  six ✓ "quoted"  '}]
    ref = hf_folder_reference.apply_chat_template(
        messages, chat_template=RICH_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert tok.apply_chat_template(messages) == ref
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("text", [TEXTS[5], TEXTS[6], TEXTS[7], TEXTS[8], TEXTS[10]])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_decoder_streams_exact_text(
    smollm: LoadedModel, text: str, skip_special_tokens: bool
) -> None:
    tok = smollm.tokenizer
    ids = tok.encode(text)
    decoder = tok.incremental_decoder(skip_special_tokens)
    pieces = [decoder.push([i]) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_decoder_holds_back_partial_characters(smollm: LoadedModel) -> None:
    tok = smollm.tokenizer
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji is split into byte tokens
    decoder = tok.incremental_decoder()
    assert [decoder.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1:]) == "😀"
    assert decoder.flush() == ""


def test_unknown_gguf_pre_tokenizer_is_named() -> None:
    vocab = GGUFVocab("gpt2", "mystery", ["a", "b"], [1, 1], [])
    with pytest.raises(ValueError, match=r"'mystery'.*known: .*smollm"):
        Tokenizer.from_gguf(vocab)
    with pytest.raises(ValueError, match="'llama'"):
        Tokenizer.from_gguf(GGUFVocab("llama", "default", ["a"], [1], []))


def test_missing_chat_template_is_a_clear_error(hf_tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_hf_folder(hf_tokenizer_dir)
    bare = Tokenizer(tok.backend, type(tok.spec)(tok.spec.eos_token_ids))
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS[0])


def test_template_and_eos_from_tokenizer_config(hf_tokenizer_dir: Path, tmp_path: Path) -> None:
    """Older folders keep the template in tokenizer_config.json; eos may be a dict."""
    shutil.copy(hf_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {
        "eos_token": {"content": "<|im_end|>", "special": True},
        "bos_token": "<|im_start|>",
        "chat_template": [
            {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"},
            {"name": "tool_use", "template": "unused"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.eos_token_ids == (2, 0)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"
