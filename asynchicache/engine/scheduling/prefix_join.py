"""Prompts that arrive together share the pages one of them computes.

Two misses with the same prefix, admitted in the same step, would each compute every
page of it. A prompt that computed nothing of its own yet (`owns_nothing`: it holds
only the tree's pages) is named by its next full page (`fresh_page`: the tree node its
prefix ends at and that page's tokens); the scheduler lets one prompt of a step compute
such a page, the others wait a step and then take what it computed from the tree
(`Scheduler._join_computed_prefixes`, `HiRadixCache.join_l1_prefix`).
"""

from __future__ import annotations

from asynchicache.engine.request import Request


def owns_nothing(req: Request, page_size: int) -> bool:
    """Every page `req` holds is the tree's and it computed no token past them."""
    held = req.shared_pages
    alone = not req.needs_whole_prompt and req.shared is None and req.group is None
    return alone and len(req.page_table) == held and req.num_computed == held * page_size


def fresh_page(req: Request, page_size: int) -> tuple[object, ...] | None:
    """What names the next full page of a prompt that computed nothing of its own yet,
    or None when it has no such page (or owns pages of its own)."""
    at = req.num_computed
    if req.handle is None or not owns_nothing(req, page_size) or req.num_tokens - at < page_size:
        return None
    return (id(req.handle.node), *req.tokens[at : at + page_size])
