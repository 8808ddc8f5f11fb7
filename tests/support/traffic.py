"""Known prompts and their greedy answers: prompts sent as token ids (so a test knows
their pages), completions checked to the end, and a steady load that counts every
failed or wrong answer."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import httpx
import openai
from host_speed import scaled
from settling import at_most

from asynchicache.model.tokenizer import Tokenizer

MAX_TOKENS = 6
PAGE_SIZE = 16

_WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
          "juniper", "kestrel", "lagoon", "mosaic", "nectar", "orchid", "pepper")  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    """A prompt sent as token ids, so the test knows exactly which pages it makes."""

    name: str
    ids: tuple[int, ...]

    @property
    def pages(self) -> list[tuple[int, ...]]:
        n = len(self.ids) // PAGE_SIZE
        return [self.ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] for i in range(n)]


def make_prompts(tok: Tokenizer, tag: str, n: int, lines: int = 14) -> list[Prompt]:
    """`n` prompts of about 10 pages whose first page already differs (no page shared)."""
    out = []
    for k in range(n):
        rng = random.Random(f"{tag}-{k}")
        body = " ".join(
            f"[{tag}{k}.{j}] {rng.choice(_WORDS)} {rng.randint(10, 999)}." for j in range(lines)
        )
        text = f"Ledger {tag}{k}: {body} The next entry is"
        out.append(Prompt(f"{tag}{k}", tuple(tok.encode(text, add_special_tokens=False))))
    return out


@dataclass(frozen=True)
class Answer:
    text: str
    cached: dict[str, int]  # cached prompt tokens by tier


class RequestFailed(Exception):
    """The server did not answer a request completely (what a load counts as failed)."""


def complete(client: httpx.Client, prompt: Prompt, stream: bool, salt: str | None = None) -> Answer:
    """A greedy /v1/completions of `prompt`; raises RequestFailed on anything incomplete."""
    body: dict[str, object] = {
        "prompt": list(prompt.ids),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if salt is not None:
        body["cache_salt"] = salt
    try:
        if stream:
            return _streamed(client, body)
        r = client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        raise RequestFailed(f"{type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise RequestFailed(f"HTTP {r.status_code}: {r.text[:300]}")
    data = r.json()
    choice = data["choices"][0]
    if choice.get("finish_reason") not in ("stop", "length"):
        raise RequestFailed(f"finish_reason {choice.get('finish_reason')!r}")
    return Answer(choice["text"], _tiers(data["usage"]))


def _streamed(client: httpx.Client, body: dict[str, object]) -> Answer:
    text, usage, reason, done = "", None, None, False
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RequestFailed(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RequestFailed(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                text += choice.get("text") or ""
                reason = choice.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
    if not done or usage is None or reason not in ("stop", "length"):
        raise RequestFailed(f"incomplete stream (done={done}, reason={reason!r})")
    return Answer(text, _tiers(usage))


def _tiers(usage: dict) -> dict[str, int]:
    return dict(usage["prompt_tokens_details"].get("cached_tokens_by_tier") or {})


def _each_once(
    url: str, prompts: Iterable[Prompt], clients: int, ask: Callable[[httpx.Client, Prompt], None]
) -> None:
    """`ask(client, prompt)` for every prompt once, from `clients` threads."""
    todo = list(prompts)
    lock = threading.Lock()

    def work() -> None:
        with httpx.Client(base_url=url, timeout=scaled(300)) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    p = todo.pop()
                ask(client, p)

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def references(url: str, prompts: Sequence[Prompt], clients: int) -> dict[str, str]:
    """Greedy answers of prompts that share no page with anything cached, each asked once."""
    out: dict[str, str] = {}
    lock = threading.Lock()

    def ask(client: httpx.Client, p: Prompt) -> None:
        # No other prompt shares a page with it, so this is a cold answer (a request
        # preempted for L1 room may report its own pages as cached on re-admission).
        answer = complete(client, p, stream=False)
        with lock:
            out[p.name] = answer.text

    _each_once(url, prompts, clients, ask)
    assert len(out) == len(prompts), "a reference request failed"
    return out


@dataclass
class LoadResult:
    served: int = 0
    failed: int = 0
    wrong: int = 0
    failures: list[str] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=dict)  # cached tokens summed by tier

    def add_tiers(self, cached: dict[str, int]) -> None:
        for tier, n in cached.items():
            self.tiers[tier] = self.tiers.get(tier, 0) + n


class Load:
    """`clients` threads asking greedy completions of known prompts until stopped.

    Half the requests stream. Every answer is compared with its reference; a
    request that errors, is cut short or answers differently is counted.
    """

    def __init__(
        self, url: str, prompts: Sequence[Prompt], expected: dict[str, str], clients: int
    ) -> None:
        self.url = url
        self.prompts = list(prompts)
        self.expected = expected
        self.result = LoadResult()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(clients)
        ]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        self._stop.set()
        for t in self._threads:
            t.join(300)
        return self.result

    def snapshot(self) -> tuple[int, int, int]:
        with self._lock:
            return self.result.served, self.result.failed, self.result.wrong

    def served_more(self, n: int, within_s: float) -> bool:
        """Whether `n` more requests (from now) were served within `within_s`; returns as
        soon as they were."""
        target = self.snapshot()[0] + n
        return at_most(within_s, lambda: self.snapshot()[0] >= target)

    def _work(self, index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(base_url=self.url, timeout=scaled(300)) as client:
            while not self._stop.is_set():
                prompt = rng.choice(self.prompts)
                self._one(client, prompt, stream=rng.random() < 0.5)

    def _one(self, client: httpx.Client, prompt: Prompt, stream: bool) -> None:
        try:
            answer = complete(client, prompt, stream)
        except RequestFailed as exc:
            with self._lock:
                self.result.failed += 1
                self.result.failures.append(f"{prompt.name}: {exc}")
            return
        with self._lock:
            self.result.served += 1
            self.result.add_tiers(answer.cached)
            if answer.text != self.expected[prompt.name]:
                self.result.wrong += 1
                self.result.failures.append(
                    f"{prompt.name}: {answer.text!r} != {self.expected[prompt.name]!r} "
                    f"(cached {answer.cached})"
                )


def ask_all(
    url: str, prompts: Iterable[Prompt], expected: dict[str, str], clients: int = 3
) -> LoadResult:
    """Every prompt once (concurrently), checked against its reference."""
    load = Load(url, [], expected, 0)
    _each_once(url, prompts, clients, lambda client, p: load._one(client, p, stream=False))
    return load.result


_COLORS = ("red", "green", "blue", "amber", "violet", "teal", "ochre")


def inventory(seed: int, boxes: int = 80) -> list[dict[str, str]]:
    """A chat prompt of about 1,600 tokens (100 pages) for 80 boxes; `seed` changes every line."""
    lines = [
        f"Box {i}: a {_COLORS[(i + seed) % 7]} box holding {(i * 37 + seed * 11) % 101} marbles "
        f"and {(i * 11 + seed) % 17} keys."
        for i in range(boxes)
    ]
    doc = "Read the inventory below, then answer.\n" + "\n".join(lines)
    return [{"role": "user", "content": f"{doc}\nHow many marbles are in box 3?"}]


def timed_chat(url: str, messages: list[dict[str, str]]) -> tuple[float, str, object]:
    """(time to first content token, greedy text, usage) of a streamed greedy chat completion."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert ttft is not None and usage is not None
    return ttft, text, usage


def by_tier(usage: object) -> dict[str, int]:
    """Cached prompt tokens by tier, from an openai client's usage."""
    return usage.prompt_tokens_details.model_extra["cached_tokens_by_tier"]  # type: ignore[attr-defined]
