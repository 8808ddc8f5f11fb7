"""A multi-turn conversation workload for `bench pressure --workload conversation`.

The shape of chat traffic (issue 40), not of a cache's best case:

* every session starts with the same short system prompt (`system_tokens`, 16
  by default: the first page is shared by all, nothing more);
* then its own opening context (a document, instructions) and a user message;
* each later turn re-sends the whole history: the previous prompt, the
  assistant's answer (here a fixed text of `reply_tokens`: the history a chat
  client keeps, which is not the text the model sampled, so its K/V is not the
  one computed while decoding) and a new user message;
* sessions come back after many others: the next request is the next turn of
  a session drawn at random among those whose last turn is at least 32
  requests back (more than 4 or 16 clients have in flight, so a turn is sent
  after the one before it was answered; only the last few sessions of a run
  come back sooner, when no other is left);
* sessions last 1 to `max_turns` turns (geometric, mean `mean_turns`).

So a turn's reusable prefix is its session's previous prompt (gone from vLLM's
own cache when many sessions came in between) or, for a first turn, only the
shared system page. `describe()` counts the 16-token pages of all prompts whose
whole prefix an earlier prompt already had (`reusable_page_fraction`: 0.345
with the defaults, the shape of the traffic measured in issue 40).

Prompts are token ids, as in `bench pressure`'s own workload, deterministic
with `seed`. Requests carry `prefix` (their session) and `params` carries
`l1_tokens` and `max_tokens`, as `PressureWorkload`'s do, so the bench runs
either.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from asynchicache.bench.workloads import text
from asynchicache.model.tokenizer import Tokenizer

PAGE = 16  # the page the reusable fraction is counted in (our and vLLM's default page)
MIN_GAP = 32  # requests between two turns of a session (more than the clients in flight)


@dataclass(frozen=True)
class ConversationParams:
    """The workload's shape (`bench pressure --workload conversation`)."""

    l1_tokens: int = 16384  # device KV of every arm, in tokens (as PressureParams')
    # The defaults give 324 turns of 347 prompt tokens on average, 34.5% of pages
    # reusable (146 sessions of one turn, 53 of two, 22 of three to six).
    sessions: int = 220
    mean_turns: float = 1.5
    max_turns: int = 6
    system_tokens: int = 16  # shared by every session
    context_tokens: int = 160  # each session's own opening
    user_tokens: int = 80
    reply_tokens: int = 120
    max_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("l1_tokens", "sessions", "max_turns", "user_tokens", "max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        for name in ("system_tokens", "context_tokens", "reply_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if not 1.0 <= self.mean_turns <= self.max_turns:
            raise ValueError("--mean-turns must be within [1, --max-turns]")

    @property
    def prefix_tokens(self) -> int:
        """A session's opening, what every one of its turns starts with (`bench pressure`
        counts a request whose cached tokens cover most of it as `fully_cached`)."""
        return self.system_tokens + self.context_tokens


@dataclass(frozen=True)
class ConversationRequest:
    prefix: int  # the session (what `bench pressure` reports as the request's prefix)
    turn: int  # 0 for the session's first
    prompt: tuple[int, ...]


@dataclass(frozen=True)
class ConversationWorkload:
    params: ConversationParams
    requests: tuple[ConversationRequest, ...]

    def describe(self) -> dict[str, Any]:
        prompts = [r.prompt for r in self.requests]
        return {
            "workload": "conversation",
            **asdict(self.params),
            "requests": len(self.requests),
            "turns": _turn_counts(self.requests),
            "prompt_tokens": sum(len(p) for p in prompts),
            "mean_prompt_tokens": round(sum(len(p) for p in prompts) / max(1, len(prompts)), 1),
            "reusable_page_fraction": round(reusable_page_fraction(prompts), 4),
        }

    def notes(self) -> str:
        """One line for the bench's plot."""
        w = self.describe()
        return (
            f"conversation: {w['sessions']} sessions, {w['requests']} turns of "
            f"{w['mean_prompt_tokens']} prompt tokens on average, "
            f"{w['reusable_page_fraction']:.0%} of 16-token pages reusable, "
            f"{w['max_tokens']} output tokens, L1 {w['l1_tokens']} tokens"
        )


def _turn_counts(requests: tuple[ConversationRequest, ...]) -> dict[str, int]:
    last: dict[int, int] = {}
    for r in requests:
        last[r.prefix] = max(last.get(r.prefix, 0), r.turn + 1)
    out: dict[str, int] = {}
    for turns in last.values():
        out[str(turns)] = out.get(str(turns), 0) + 1
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def reusable_page_fraction(prompts: list[tuple[int, ...]]) -> float:
    """Of all full 16-token pages of all prompts, in order, those whose whole prefix
    (every token up to the page's end) an earlier prompt had: the most any cache of
    unbounded size could serve."""
    seen: set[tuple[int, ...]] = set()
    pages = reused = 0
    for prompt in prompts:
        for end in range(PAGE, len(prompt) + 1, PAGE):
            key = prompt[:end]
            pages += 1
            if key in seen:
                reused += 1
            else:
                seen.add(key)
    return reused / pages if pages else 0.0


def _ids(tokenizer: Tokenizer, rng: random.Random, n: int, question: bool = False) -> list[int]:
    if n == 0:
        return []
    words = text.question(rng, n * 3 // 2 + 8) if question else text.text(rng, n * 3 // 2 + 8)
    ids = tokenizer.encode(words, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"generated text gave {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def _turns(rng: random.Random, params: ConversationParams) -> int:
    """1 to max_turns, geometric with mean ~mean_turns."""
    p = 1.0 / params.mean_turns
    turns = 1
    while turns < params.max_turns and rng.random() > p:
        turns += 1
    return turns


def build(params: ConversationParams, tokenizer: Tokenizer) -> ConversationWorkload:
    """Every turn of every session, in the order the clients send them."""
    rng = random.Random(params.seed)
    system = _ids(tokenizer, rng, params.system_tokens)
    history: dict[int, list[int]] = {}
    left: dict[int, int] = {}
    for s in range(params.sessions):
        opening = _ids(tokenizer, rng, params.context_tokens)
        history[s] = system + opening
        left[s] = _turns(rng, params)
    requests: list[ConversationRequest] = []
    turns = dict.fromkeys(history, 0)
    last: dict[int, int] = {}  # session -> index of its latest turn
    while any(left.values()):
        going = [s for s in history if left[s] > 0]
        # A session comes back only MIN_GAP requests after its last turn (its user
        # read the answer), while another one can go instead.
        ready = [s for s in going if s not in last or len(requests) - last[s] >= MIN_GAP]
        s = rng.choice(ready) if ready else min(going, key=lambda g: last.get(g, -1))
        if turns[s]:  # the answer to the previous turn, as the client's history has it
            history[s] += _ids(tokenizer, rng, params.reply_tokens)
        history[s] += _ids(tokenizer, rng, params.user_tokens, question=True)
        requests.append(ConversationRequest(s, turns[s], tuple(history[s])))
        last[s], turns[s], left[s] = len(requests) - 1, turns[s] + 1, left[s] - 1
    return ConversationWorkload(params, tuple(requests))


def warm_up_prompt(params: ConversationParams, tokenizer: Tokenizer) -> list[int]:
    """A prompt of a first turn's shape that shares no page with the run (not even the
    system page: the run's first requests must find it cold, as a fresh server would)."""
    rng = random.Random(params.seed + 7919)
    n = params.system_tokens + params.context_tokens + params.user_tokens
    return _ids(tokenizer, rng, n)
