"""Text <-> token ids: the tokenizer, the chat template and streaming detokenization.

A `Tokenizer` wraps a `tokenizers.Tokenizer`, built from a Hugging Face
`tokenizer.json` or from a GGUF file's own vocabulary and merges (byte-level
BPE with the pre-tokenizer that `tokenizer.ggml.pre` names). Chat templates are
rendered with jinja2 the way transformers renders them, so prompts (and so the
KV cache's page hashes) agree with the reference stack.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (same regexes).
_GGUF_PRE_TOKENIZERS = MappingProxyType(
    {
        "default": _byte_level,
        "gpt2": _byte_level,
        "gpt-2": _byte_level,
        "smollm": _digits_then_byte_level,
        "starcoder": _digits_then_byte_level,
        "refact": _digits_then_byte_level,
        "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
        "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
        "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
    }
)


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer part of a GGUF file's metadata (`tokenizer.ggml.*`)."""

    model: str
    pre: str
    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str]
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None


@dataclass(frozen=True)
class SpecialTokens:
    """Special token strings as the chat template sees them."""

    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None

    def as_template_vars(self) -> dict[str, str]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything besides the `tokenizers` backend that a Tokenizer needs."""

    eos_token_ids: tuple[int, ...]
    special: SpecialTokens = field(default_factory=SpecialTokens)
    chat_template: str | None = None


class Tokenizer:
    """encode/decode, chat template and streaming detokenizers for one model."""

    def __init__(self, backend: HFTokenizer, spec: TokenizerSpec) -> None:
        self.backend = backend
        self.spec = spec
        self._template = None if spec.chat_template is None else _compile(spec.chat_template)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.spec.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch_fast lets go of the GIL while it works (encode holds it: a 1 MB
        # prompt stopped every other thread for 3 s) and keeps no offsets (freeing them
        # alone held the GIL 0.15 s); the ids are the same.
        batch = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return batch[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (e.g. 'Ġhello'), for /tokenize."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render `messages` as transformers' apply_chat_template(tokenize=False) does."""
        if self._template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt")
        variables = {
            **self.spec.special.as_template_vars(),
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            **extra,
        }
        return self._template.render(**variables)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    @classmethod
    def from_hf_folder(cls, folder: Path) -> Tokenizer:
        """From tokenizer.json (+ tokenizer_config.json, chat_template.jinja, eos lists)."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (needed for the tokenizer)")
        backend = HFTokenizer.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        special = SpecialTokens(
            **{
                name: _token_text(config.get(name))
                for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            }
        )
        eos = _eos_ids(backend, special, folder)
        spec = TokenizerSpec(eos, special, _hf_chat_template(folder, config))
        return cls(backend, spec)

    @classmethod
    def from_gguf(cls, vocab: GGUFVocab) -> Tokenizer:
        """Byte-level BPE from a GGUF's own vocabulary, merges and pre-tokenizer."""
        if vocab.model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {vocab.model!r} is not supported; "
                "known: 'gpt2' (byte-level BPE)"
            )
        make_pre = _GGUF_PRE_TOKENIZERS.get(vocab.pre)
        if make_pre is None:
            known = ", ".join(_GGUF_PRE_TOKENIZERS)
            raise ValueError(f"unknown GGUF pre-tokenizer {vocab.pre!r}; known: {known}")
        backend = _gguf_backend(vocab)
        backend.pre_tokenizer = make_pre()
        backend.decoder = decoders.ByteLevel()
        bos = None if vocab.bos_token_id is None else vocab.tokens[vocab.bos_token_id]
        if vocab.add_bos_token and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, vocab.bos_token_id)],
            )
        special = SpecialTokens(
            bos_token=bos,
            eos_token=vocab.tokens[vocab.eos_token_ids[0]] if vocab.eos_token_ids else None,
            unk_token=None if vocab.unk_token_id is None else vocab.tokens[vocab.unk_token_id],
            pad_token=None if vocab.pad_token_id is None else vocab.tokens[vocab.pad_token_id],
        )
        return cls(backend, TokenizerSpec(vocab.eos_token_ids, special, vocab.chat_template))


# A UTF-8 character is at most 4 bytes, so an incomplete one at the end of the text spans
# at most 3 tokens (each carries at least a byte); text still ending in U+FFFD after more
# held tokens than that has bytes that never complete, and is let go.
MAX_HELD_TOKENS = 4
MAX_INCOMPLETE_TOKENS = 3


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of text.

    Decodes a short window of recent tokens and emits only what is new, holding
    back text that ends in an incomplete UTF-8 sequence (a byte-level token may
    carry part of a character) until the following tokens complete it. The hold is
    bounded (MAX_HELD_TOKENS): a stream of lone bytes, or of tokens that decode to
    nothing, would otherwise decode an ever longer window at every token (issue 39:
    N^2 / 2 ids for N tokens); past the bound, all but the last MAX_INCOMPLETE_TOKENS
    held tokens are let go, so a character that starts among those still arrives whole.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: decoded again for context
        self.read_offset = 0  # tokens before this have been emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """Feed new token ids; returns the text they complete (maybe '')."""
        self.ids.extend(token_ids)
        end = len(self.ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset : end])
        held_long = end - self.read_offset >= MAX_HELD_TOKENS
        if not held_long and (len(text) <= len(prefix) or text.endswith("\ufffd")):
            return ""
        if held_long and text.endswith("\ufffd"):
            end -= MAX_INCOMPLETE_TOKENS
            text = self._decode(self.ids[self.prefix_offset : end])
        self.prefix_offset, self.read_offset = self.read_offset, end
        return text[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _merge_pair(merge: str) -> tuple[str, str]:
    """A GGUF merge "a b" as BPE's pair."""
    first, sep, second = merge.partition(" ")
    if not sep:
        raise ValueError(f"a BPE merge is two tokens and a space, got {merge!r}")
    return first, second


def _gguf_backend(vocab: GGUFVocab) -> HFTokenizer:
    ids = {token: i for i, token in enumerate(vocab.tokens)}
    merges = [_merge_pair(m) for m in vocab.merges]
    unk = None if vocab.unk_token_id is None else vocab.tokens[vocab.unk_token_id]
    backend = HFTokenizer(models.BPE(ids, merges, unk_token=unk, fuse_unk=False))
    added = [
        AddedToken(token, special=kind == _CONTROL, normalized=False)
        for token, kind in zip(vocab.tokens, vocab.token_types, strict=True)
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])
    return backend


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _eos_ids(backend: HFTokenizer, special: SpecialTokens, folder: Path) -> tuple[int, ...]:
    """eos of the tokenizer, then of generation_config.json and config.json."""
    ids: list[int] = []
    eos = None if special.eos_token is None else backend.token_to_id(special.eos_token)
    if eos is not None:
        ids.append(eos)
    for name in ("generation_config.json", "config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        for item in value if isinstance(value, list) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja wins (transformers >= 4.47 saves it there), then the config."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t["name"]: t["template"] for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text; we just render it."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 reads the class attribute, a set)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(source: str) -> jinja2.Template:
    """The environment transformers uses: sandboxed, trim_blocks, lstrip_blocks."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
