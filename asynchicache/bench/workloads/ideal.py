"""The best a prefix cache could do on a request sequence: an upper bound on its hit rate.

An unbounded page-level replay of the requests in the order they were sent.
Each prompt is cut into full pages; a page can hit when the same page, after
the same earlier pages, was in an earlier request (a trie over pages, so the
chain of predecessors is what matters, as with the cache's chained page
hashes). As in the engine, the last prompt token is computed (its logits
give the first sample): every full page may hit, but a prompt that ends on a
page boundary hits at most `len - 1` tokens; except a prompt sent before
whole, which hits every token (the engine keeps recent prompts' last logits,
engine/sampling/prompt_logits.py; here they are never dropped).

Generated tokens are cached too: a request that decodes `decode_tokens` tokens
leaves KV for its prompt and the first `decode_tokens - 1` of them (the last
sampled token is never fed back), and a later prompt that repeats them (the
next turn of a chat) hits those pages. The replay does not know which tokens
were generated, so it assumes the most favourable ones: any later prompt that
agrees with an earlier prompt up to its end may hit up to that request's
prompt length + `decode_tokens - 1` tokens. Everything comes from the
requests alone (never from a server's counters), and every assumption errs on
the generous side, so no real cache can beat this rate:

- pages become cached the moment their request is sent (a real cache waits for
  the prefill, and for the decode for generated pages);
- nothing is ever evicted; generated tokens are whatever the next prompt needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Replay:
    """Totals of one replay: prompt tokens, hit tokens, and the distinct pages seen."""

    prompt_tokens: int
    hit_tokens: int
    distinct_pages: int
    page_size: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def working_set_tokens(self) -> int:
        """Tokens in the distinct full prompt pages: what an unbounded cache holds of prompts."""
        return self.distinct_pages * self.page_size


@dataclass
class _Node:
    """Pages after the same chain of pages; `ends`: requests whose prompt's full pages end here.

    `ends` maps a prompt's tokens past its last full page (the partial page)
    to the most tokens of that sequence a cache may hold once the request
    decoded: prompt + generated tokens fed back.
    """

    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)

    def reach(self, tokens: Sequence[int], at: int) -> int:
        """Most tokens of `tokens` that a request ending here may have cached.

        `at`: where this node's pages end in `tokens`. A request counts only when
        `tokens` continue with its partial page: past it came generated tokens,
        which may be anything."""
        best = 0
        for tail, reach in self.ends.items():
            if reach > best and tuple(tokens[at : at + len(tail)]) == tail:
                best = reach
        return best


class _Trie:
    def __init__(self, page_size: int, decode_tokens: int) -> None:
        self.page_size = page_size
        self.decode_tokens = decode_tokens
        self.root = _Node()
        self.distinct = 0
        self.sent: set[tuple[int, ...]] = set()  # whole prompts: their last logits are kept

    def pages(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i * ps : (i + 1) * ps]) for i in range(len(tokens) // ps)]

    def hit_tokens(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` an unbounded cache may serve (before adding them)."""
        if tuple(tokens) in self.sent:
            return len(tokens)
        node, depth, reach = self.root, 0, 0
        for page in self.pages(tokens):
            reach = max(reach, node.reach(tokens, depth * self.page_size))
            child = node.children.get(page)
            if child is None:
                break
            node, depth = child, depth + 1
        else:
            reach = max(reach, node.reach(tokens, depth * self.page_size))
        pages = min(len(tokens) // self.page_size, max(depth, reach // self.page_size))
        return min(pages * self.page_size, max(0, len(tokens) - 1))

    def add(self, tokens: Sequence[int]) -> None:
        """`tokens` was sent: its pages, then its generated tokens, may be cached."""
        self.sent.add(tuple(tokens))
        node = self.root
        for page in self.pages(tokens):
            child = node.children.get(page)
            if child is None:
                child = node.children[page] = _Node()
                self.distinct += 1
            node = child
        tail = tuple(tokens[len(tokens) - len(tokens) % self.page_size :])
        reach = len(tokens) + max(0, self.decode_tokens - 1)
        node.ends[tail] = max(reach, node.ends.get(tail, 0))


def replay(
    prompts: Sequence[Sequence[int]],
    page_size: int,
    warm: Sequence[Sequence[int]] = (),
    decode_tokens: int = 0,
) -> Replay:
    """Replay `prompts` in order through an unbounded prefix cache of `page_size` pages.

    `warm` prompts are added first without being counted: what a cache that
    survived a restart holds from an earlier run, or requests that failed
    (their prefill may still have been cached). `decode_tokens`: tokens each
    request generates (the benchmarks decode exactly `max_tokens`, `ignore_eos`).
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    if decode_tokens < 0:
        raise ValueError(f"decode_tokens must be >= 0, got {decode_tokens}")
    trie = _Trie(page_size, decode_tokens)
    for tokens in warm:
        trie.add(tokens)
    total = hits = 0
    for tokens in prompts:
        total += len(tokens)
        hits += trie.hit_tokens(tokens)
        trie.add(tokens)
    return Replay(total, hits, trie.distinct, page_size)
