"""`BoundedTokenizer`: the HTTP process's tokenizer, refusing a text longer than the
context before it tokenizes it.

No token of the vocabulary stands for more than `max_token_bytes` bytes of text (the
longest entry, as UTF-8; a normalizer that may shrink text, as NFKC folds a 3-byte
character into 1, is allowed `NORMALIZED_SHRINK` times that), so a text of more than
`max_model_len x max_token_bytes` bytes has more tokens than the context holds, and is
answered 400 (context_length_exceeded) at once: an 8 MiB prompt is refused in a
millisecond instead of tokenized for seconds into a gigabyte. Below the bound the text is
tokenized (off the event loop: the callers run in a worker thread, and the tokenizer lets
go of the GIL) and the exact count is checked as before. The same bound gives the work
bound (server/guards/work_bound.py) a least count of a text's tokens before it is tokenized.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from asynchicache.model.tokenizer import Tokenizer
from asynchicache.server.context import IncrementalText
from asynchicache.server.errors import APIError

NORMALIZED_SHRINK = 4  # a character's UTF-8 bytes that a normalizer may fold into one


class BoundedTokenizer:
    """`inner` (the engine's tokenizer) whose `encode` refuses texts that cannot fit the
    context; a TextTokenizer."""

    def __init__(self, inner: Tokenizer, max_model_len: int, max_token_bytes: int) -> None:
        self.inner = inner
        self.max_model_len = max_model_len
        self.max_token_bytes = max_token_bytes
        self.max_bytes = max_model_len * max_token_bytes

    @property
    def eos_token_ids(self) -> Collection[int]:
        return self.inner.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # len(text) <= UTF-8 bytes <= 4 * len(text): most texts are decided without encoding.
        if len(text) > self.max_bytes or (
            4 * len(text) > self.max_bytes and len(text.encode("utf-8")) > self.max_bytes
        ):
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens, but the "
                f"prompt's text ({len(text)} characters) has more. Please shorten the prompt.",
                param="prompt",
                code="context_length_exceeded",
            )
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def fewest_tokens(self, text: str) -> int:
        """A least token count of `text`, without tokenizing it: no token stands for more
        than `max_token_bytes` bytes, and a character is at least one byte."""
        return -(-len(text) // self.max_token_bytes)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return self.inner.token_strs(ids)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.inner.apply_chat_template(messages, add_generation_prompt)

    def incremental_decoder(self) -> IncrementalText:
        return self.inner.incremental_decoder()
