"""Admission by memory: a request enters only when L1 can hold what it will need.

L1 holds both the cached prefixes and the KV of running requests. Admitting
by count alone (at most N running) lets requests in whose pages do not fit;
each then preempts the newest, whose prefill is thrown away, and the next step
admits it again (a preemption storm). So, as nano-vllm's `can_allocate` and
mini-sglang's prefill adder do, the scheduler admits the oldest waiting request
only while

    need(request) <= available - outstanding(every admitted request)

* `available`: L1 pages `allocate` could hand out now, free plus unlocked
  cached ones (`HiRadixCache.available_pages`);
* `target`: the pages a request holds once its prompt, its output so far and
  a reserved stretch of decoding (`--decode-reserve-tokens`, at most its
  `max_tokens`) are in L1, plus one page for a copy (the copy-on-write of a
  whole hit, a follower's partial page) and, for a request group, each
  follower's own decode pages;
* `outstanding`: target less what an admitted request holds already (its page
  table; for a load, the L1 prefix and the pages the load reserved);
* `need`: target less the pages of its L1 prefix that some lock protects
  already (locking the others takes them out of `available`).

A load's L1 pages come out of the same budget: the load reserves them
(FILLING) when it starts, so they leave `available` as the request's page
table would. Decoding past the reserved stretch allocates as it goes, and when
L1 runs out the scheduler preempts the newest request; admission then backs
off until a running request finishes, so the preempted one is not admitted
again into the same shortage.
"""

from __future__ import annotations

from asynchicache.engine.request import Phase, Request


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class MemoryBudget:
    """The page arithmetic of admission (the module docstring); no state of its own."""

    def __init__(self, page_size: int, decode_reserve_tokens: int) -> None:
        self.page_size = page_size
        self.decode_reserve_tokens = decode_reserve_tokens

    def _decode_tokens(self, req: Request) -> int:
        reserve = min(req.sampling.max_tokens, self.decode_reserve_tokens)
        return max(len(req.output) + 1, reserve)

    def target(self, req: Request) -> int:
        """Pages `req` holds with its reserved decoding in L1 (see the module docstring)."""
        decode = self._decode_tokens(req)
        own = pages_for(len(req.prompt) + decode, self.page_size) + 1
        followers = len(req.group.followers) if req.group is not None else 0
        return own + followers * (pages_for(decode, self.page_size) + 1)

    def held(self, req: Request) -> int:
        """L1 pages an admitted request holds or has reserved already."""
        ticket = req.load_ticket
        if req.phase is Phase.LOADING and ticket is not None:
            device = req.cached.device // self.page_size
            return device + ticket.pages_from_host + ticket.pages_from_storage
        return len(req.page_table)

    def outstanding(self, admitted: list[Request]) -> int:
        """Pages admitted requests will still take from L1."""
        return sum(max(0, self.target(r) - self.held(r)) for r in admitted)

    def need(self, req: Request, locked_prefix_pages: int) -> int:
        """Pages admitting `req` takes out of `available` (now and later)."""
        return max(0, self.target(req) - locked_prefix_pages)
