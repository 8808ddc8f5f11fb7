"""The best a prefix cache could do on a request sequence: an unbounded page-level replay.

Each prompt is cut into full pages; a page hits when the same page, after the
same earlier pages, was in an earlier prompt (a trie over pages, so the chain
of predecessors is what matters, as with the cache's chained page hashes). As
in the engine, the last prompt token is always computed, so at most
`(len - 1) // page_size` pages can hit. Answers are not inserted: the cache
may also reuse the pages of generated tokens, so a real hit rate can exceed
this one slightly in chat workloads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PageTrie = dict[tuple[int, ...], "PageTrie"]


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
        """Tokens in the distinct full pages of all prompts: what an unbounded cache holds."""
        return self.distinct_pages * self.page_size


def _pages(tokens: Sequence[int], page_size: int) -> list[tuple[int, ...]]:
    n = len(tokens) // page_size
    return [tuple(tokens[i * page_size : (i + 1) * page_size]) for i in range(n)]


def _insert(root: PageTrie, tokens: Sequence[int], page_size: int) -> None:
    node = root
    for page in _pages(tokens, page_size):
        node = node.setdefault(page, {})


def _count_distinct(node: PageTrie) -> int:
    stack, n = [node], 0
    while stack:
        children = stack.pop()
        n += len(children)
        stack.extend(children.values())
    return n


def replay(
    prompts: Sequence[Sequence[int]], page_size: int, warm: Sequence[Sequence[int]] = ()
) -> Replay:
    """Replay `prompts` in order through an unbounded prefix cache of `page_size` pages.

    `warm` prompts are inserted first without being counted: what a cache that
    survived a restart holds from an earlier run.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    root: PageTrie = {}
    for tokens in warm:
        _insert(root, tokens, page_size)
    distinct = _count_distinct(root)
    total = hits = 0
    for tokens in prompts:
        total += len(tokens)
        limit = max(0, (len(tokens) - 1) // page_size)
        node = root
        for i, page in enumerate(_pages(tokens, page_size)):
            child = node.get(page)
            if child is None:  # and so every later page of this prompt is new too
                child = node[page] = {}
                distinct += 1
            elif i < limit:
                hits += page_size
            node = child
    return Replay(total, hits, distinct, page_size)
