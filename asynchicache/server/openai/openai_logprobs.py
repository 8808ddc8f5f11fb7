"""Engine logprobs (`TokenLogprob`) in OpenAI's two response shapes.

* `/v1/completions`: parallel lists `tokens`, `token_logprobs`, `top_logprobs`
  (a dict token -> logprob that also holds the chosen token, so up to k + 1
  entries) and `text_offset` (characters before each token in the returned
  text, echoed prompt included). With echo the prompt's first token has no
  logprob (null), as in OpenAI's API.
* `/v1/chat/completions`: `content` is a list of {token, logprob, bytes,
  top_logprobs: [k alternatives]}.

A token's string is its own decoding (special tokens spelled out); a token that
is part of a multi-byte character decodes to U+FFFD, its `bytes` are those of
that string. Logprobs below -9999 (float underflow) are reported as -9999,
since JSON has no -Infinity.
"""

from __future__ import annotations

from collections.abc import Sequence

from asynchicache.engine.protocol import TokenLogprob
from asynchicache.server.context import TextTokenizer
from asynchicache.server.openai.schemas import ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs

FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, FLOOR) if value == value else FLOOR  # NaN never leaves the server


class TokenText:
    """Token id -> its string, memoized per request (prompts repeat tokens)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._memo: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._memo.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._memo[token_id] = text
        return text


class CompletionLogprobsBuilder:
    """Builds `CompletionLogprobs` piece by piece (one per streamed chunk), keeping the
    text offset across pieces."""

    def __init__(self, text: TokenText) -> None:
        self._text = text
        self._offset = 0

    def prompt(
        self, prompt_ids: Sequence[int], entries: Sequence[TokenLogprob]
    ) -> CompletionLogprobs:
        """The echoed prompt: its first token has no logprob; entries[j] is prompt[j + 1]'s."""
        out = CompletionLogprobs()
        self._append(out, prompt_ids[0], None)
        for token_id, entry in zip(prompt_ids[1:], entries, strict=False):
            self._append(out, token_id, entry)
        return out

    def tokens(self, entries: Sequence[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for entry in entries:
            self._append(out, entry.token_id, entry)
        return out

    def _append(self, out: CompletionLogprobs, token_id: int, entry: TokenLogprob | None) -> None:
        token = self._text(token_id)
        out.tokens.append(token)
        out.text_offset.append(self._offset)
        self._offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            return
        out.token_logprobs.append(_lp(entry.logprob))
        top = {
            self._text(t): _lp(lp) for t, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)
        }
        top.setdefault(token, _lp(entry.logprob))
        out.top_logprobs.append(top)


def merge(pieces: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for piece in pieces:
        out.tokens += piece.tokens
        out.token_logprobs += piece.token_logprobs
        out.top_logprobs += piece.top_logprobs
        out.text_offset += piece.text_offset
    return out


def chat_logprobs(text: TokenText, entries: Sequence[TokenLogprob]) -> list[ChatTokenLogprob]:
    out = []
    for entry in entries:
        token = text(entry.token_id)
        top = [
            ChatTopLogprob(token=(t := text(tid)), logprob=_lp(lp), bytes=list(t.encode()))
            for tid, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)
        ]
        out.append(
            ChatTokenLogprob(
                token=token,
                logprob=_lp(entry.logprob),
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return out
