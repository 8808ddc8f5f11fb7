"""Serving workloads: who asks what, in which order, and when.

A workload is a set of sessions and a dispatch order. A session has an
optional system prompt, optional context (a document) and a list of
questions; in a `chat` session each question carries the previous questions
and answers, so its next request is sent only after the previous answer came
back. Arrival times follow a Poisson process at `rate` requests/s (a request
whose previous turn is still running waits for it).

Everything is drawn from `random.Random(seed)`: the same seed gives the same
prompts and arrival times. Answers are generated with `ignore_eos` and a fixed
`max_tokens`, so every configuration of a sweep decodes the same amount.

    multiturn   users x rounds of chat over one shared system prompt, round-robin over users
    longdoc     long documents, each asked several questions, documents cycled so that
                the working set is every document
    sysprompt   many short questions behind a few long shared system prompts
"""

from __future__ import annotations

import dataclasses
import random
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from asynchicache.bench.workloads import text

Message = dict[str, str]


@dataclass(frozen=True)
class Session:
    """Requests that belong together: one user's chat, or the questions on one document."""

    system: str
    context: str
    questions: tuple[str, ...]
    chat: bool

    def user_text(self, turn: int) -> str:
        q = self.questions[turn]
        return f"{self.context}\n\nQuestion: {q}" if self.context else q

    def messages(self, turn: int, answers: Sequence[str]) -> list[Message]:
        """The chat messages of request `turn`; `answers` are this session's earlier answers."""
        msgs: list[Message] = []
        if self.system:
            msgs.append({"role": "system", "content": self.system})
        if self.chat:
            if len(answers) < turn:
                raise ValueError(f"turn {turn} needs {turn} earlier answers, got {len(answers)}")
            for i in range(turn):
                msgs.append({"role": "user", "content": self.user_text(i)})
                msgs.append({"role": "assistant", "content": answers[i]})
        msgs.append({"role": "user", "content": self.user_text(turn)})
        return msgs


@dataclass(frozen=True)
class RequestSpec:
    """One request in dispatch order: which session's which turn, and when it arrives."""

    session: int
    turn: int
    arrival_s: float


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    requests: tuple[RequestSpec, ...]
    max_tokens: int
    params: Mapping[str, float | int]

    def messages(self, spec: RequestSpec, answers: Sequence[str]) -> list[Message]:
        return self.sessions[spec.session].messages(spec.turn, answers)

    def waits_for_previous(self, spec: RequestSpec) -> bool:
        return self.sessions[spec.session].chat and spec.turn > 0


# ------------------------------------------------------------------ parameters
def _scaled(tokens: int, scale: float) -> int:
    return max(8, round(tokens * scale))


@dataclass(frozen=True)
class WorkloadParams:
    """A workload's knobs; `scaled` multiplies the prompt lengths named in `SCALED`."""

    SCALED: typing.ClassVar[tuple[str, ...]] = ()

    def scaled(self, x: float) -> typing.Self:
        return dataclasses.replace(self, **{n: _scaled(getattr(self, n), x) for n in self.SCALED})


@dataclass(frozen=True)
class MultiturnParams(WorkloadParams):
    SCALED = ("system_tokens", "question_tokens")

    users: int = 16
    rounds: int = 4
    system_tokens: int = 200
    question_tokens: int = 40
    max_tokens: int = 8
    rate: float = 0.5  # requests/s


@dataclass(frozen=True)
class LongdocParams(WorkloadParams):
    SCALED = ("min_doc_tokens", "max_doc_tokens")

    docs: int = 8
    min_doc_tokens: int = 2000
    max_doc_tokens: int = 8000
    questions: int = 3
    question_tokens: int = 30
    max_tokens: int = 8
    rate: float = 0.2


@dataclass(frozen=True)
class SyspromptParams(WorkloadParams):
    SCALED = ("system_tokens",)

    prompts: int = 4
    system_tokens: int = 1500
    requests: int = 64
    question_tokens: int = 30
    max_tokens: int = 8
    rate: float = 2.0


Params = MultiturnParams | LongdocParams | SyspromptParams


def _check(params: Params) -> None:
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if value <= 0:
            raise ValueError(f"workload parameter {f.name} must be positive, got {value}")


def override(params: Params, assignments: Sequence[str]) -> Params:
    """Apply `name=value` strings (from `--set`), converted to the field's type."""
    hints = typing.get_type_hints(type(params))
    changes: dict[str, Any] = {}
    for item in assignments:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in hints:
            known = ", ".join(hints)
            raise ValueError(f"--set {item!r}: expected NAME=VALUE with NAME one of {known}")
        changes[name] = hints[name](value)
    return dataclasses.replace(params, **changes)


# ------------------------------------------------------------------ generators
def poisson_arrivals(rng: random.Random, rate: float, n: int) -> tuple[float, ...]:
    """Arrival offsets (s) of `n` requests of a Poisson process at `rate` requests/s."""
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return tuple(out)


def _with_arrivals(
    order: Sequence[tuple[int, int]], rate: float, seed: int
) -> tuple[RequestSpec, ...]:
    # A separate stream: changing the rate leaves the text as it was.
    times = poisson_arrivals(random.Random(seed + 1_000_003), rate, len(order))
    return tuple(RequestSpec(s, t, a) for (s, t), a in zip(order, times, strict=True))


def multiturn(p: MultiturnParams, seed: int) -> Workload:
    rng = random.Random(seed)
    system = "You are the archivist of a river town. Answer from these notes.\n\n"
    system += text.text(rng, p.system_tokens)
    sessions = tuple(
        Session(
            system,
            "",
            tuple(text.question(rng, p.question_tokens) for _ in range(p.rounds)),
            chat=True,
        )
        for _ in range(p.users)
    )
    # Round-robin: between two rounds of one user every other user speaks, so
    # the whole working set passes through the cache before a prefix returns.
    order = [(u, r) for r in range(p.rounds) for u in range(p.users)]
    return Workload(
        "multiturn",
        sessions,
        _with_arrivals(order, p.rate, seed),
        p.max_tokens,
        dataclasses.asdict(p),
    )


def _doc_lengths(p: LongdocParams, rng: random.Random) -> list[int]:
    if p.docs == 1:
        return [p.max_doc_tokens]
    span = p.max_doc_tokens - p.min_doc_tokens
    lengths = [p.min_doc_tokens + round(span * i / (p.docs - 1)) for i in range(p.docs)]
    rng.shuffle(lengths)
    return lengths


def longdoc(p: LongdocParams, seed: int) -> Workload:
    if p.min_doc_tokens > p.max_doc_tokens:
        raise ValueError("workload parameter min_doc_tokens must be <= max_doc_tokens")
    rng = random.Random(seed)
    system = "Answer the question using only the document the user gives."
    sessions = []
    for length in _doc_lengths(p, rng):
        doc = "Document:\n" + text.text(rng, length)
        qs = tuple(text.question(rng, p.question_tokens) for _ in range(p.questions))
        sessions.append(Session(system, doc, qs, chat=False))
    # Cycle through every document before asking the next question of the first.
    order = [(d, q) for q in range(p.questions) for d in range(p.docs)]
    return Workload(
        "longdoc",
        tuple(sessions),
        _with_arrivals(order, p.rate, seed),
        p.max_tokens,
        dataclasses.asdict(p),
    )


def sysprompt(p: SyspromptParams, seed: int) -> Workload:
    rng = random.Random(seed)
    systems = [
        f"You are assistant number {i} of the harbour office. Follow this handbook.\n\n"
        + text.text(rng, p.system_tokens)
        for i in range(p.prompts)
    ]
    picks = [rng.randrange(p.prompts) for _ in range(p.requests)]
    questions: list[list[str]] = [[] for _ in systems]
    order = []
    for s in picks:
        order.append((s, len(questions[s])))
        questions[s].append(text.question(rng, p.question_tokens))
    pairs = zip(systems, questions, strict=True)
    sessions = tuple(Session(system, "", tuple(qs), chat=False) for system, qs in pairs)
    return Workload(
        "sysprompt",
        sessions,
        _with_arrivals(order, p.rate, seed),
        p.max_tokens,
        dataclasses.asdict(p),
    )


@dataclass(frozen=True)
class WorkloadKind:
    defaults: Params
    build: Callable[[typing.Any, int], Workload]


WORKLOADS: Mapping[str, WorkloadKind] = MappingProxyType(
    {
        "multiturn": WorkloadKind(MultiturnParams(), multiturn),
        "longdoc": WorkloadKind(LongdocParams(), longdoc),
        "sysprompt": WorkloadKind(SyspromptParams(), sysprompt),
    }
)


def make_workload(
    name: str, seed: int = 0, scale: float = 1.0, assignments: Sequence[str] = ()
) -> Workload:
    """The workload `name`, its lengths multiplied by `scale`, then the `--set` overrides."""
    kind = WORKLOADS.get(name)
    if kind is None:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if scale <= 0:
        raise ValueError(f"--scale must be positive, got {scale}")
    params = override(kind.defaults.scaled(scale), assignments)
    _check(params)
    return kind.build(params, seed)
