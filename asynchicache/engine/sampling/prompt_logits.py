"""The logits of recent prompts' last positions: an exact repeat samples at once.

A prompt cached whole still needs its last position's logits before its first
token: without them a repeat computes its partial last page (up to a page of
tokens, every weight read once) first, ~30 of a ~50 ms warm TTFT on SmolLM2
here. Those logits are a function of the prompt and of what names its pages
(`Namespace`: weights, dtype, layout, engine and numerics; and the salt), so
they are kept here by that name. A repeat draws its first token from them
before any forward (`Engine._answer_early`), then waits in the queue like a
preempted request: matched, it computes its tail with that token in one step
and samples its second. Greedy, it gives the tokens a recompute gives; seeded,
the same draws (the first comes from its generator first, as before).

Not used where the first token needs more than these logits: prompt logprobs
(every position's), a group of n > 1 (its members fork from the leader's
forward), max_tokens 0, the prefix cache off. Kept in the engine's memory, on
the logits' device, bounded in bytes (`--prompt-logits-mib`, 0 turns it off),
least recently used out first; a clear of the device tier empties it (one
salt's entries, or all), as it does L1.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch
import xxhash

from asynchicache.common.keys import Namespace
from asynchicache.engine.request import Request

MIB = 2**20


@dataclass
class PromptLogitsStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0  # first tokens drawn from a kept row
    stored: int = 0


class PromptLogits:
    """Last-position logits by prompt name (module docstring)."""

    def __init__(self, namespace: Namespace, budget_mib: int) -> None:
        self._namespace = namespace.encode()
        self.budget_bytes = budget_mib * MIB
        self._rows: OrderedDict[bytes, tuple[str, torch.Tensor]] = OrderedDict()  # -> salt, row
        self._bytes = 0
        self.hits = 0
        self.stored = 0

    def name(self, prompt: list[int], salt: str) -> bytes:
        """The prompt's name: the namespace, the salt (length-prefixed) and every token."""
        h = xxhash.xxh3_128(self._namespace)
        salt_bytes = salt.encode()
        h.update(len(salt_bytes).to_bytes(4, "little") + salt_bytes)
        h.update(array("i", prompt).tobytes())  # ids are checked to fit the vocab at the edge
        return h.digest()

    @staticmethod
    def usable(req: Request) -> bool:
        """Its first token needs nothing but the last position's logits (module docstring)."""
        sp = req.sampling
        return (not req.output and req.group is None and req.index == 0
                and sp.prompt_logprobs is None and sp.max_tokens > 0)  # fmt: skip

    def get(self, req: Request) -> torch.Tensor | None:
        """The kept row [vocab] of `req`'s prompt, or None; a hit counts."""
        if self.budget_bytes <= 0 or not self.usable(req):
            return None
        key = self.name(req.prompt, req.cache_salt)
        entry = self._rows.get(key)
        if entry is None:
            return None
        self._rows.move_to_end(key)
        self.hits += 1
        return entry[1]

    def put(self, req: Request, row: torch.Tensor) -> None:
        """Keep `row` (the raw logits [vocab] that `req`'s first token is drawn from)."""
        size = row.numel() * row.element_size()
        if size > self.budget_bytes or req.output or req.index != 0:
            return
        key = self.name(req.prompt, req.cache_salt)
        self._drop(key)
        self._rows[key] = (req.cache_salt, row.detach().clone())
        self._bytes += size
        self.stored += 1
        while self._bytes > self.budget_bytes:
            self._drop(next(iter(self._rows)))

    def clear(self, salt: str | None = None) -> int:
        """Forget every row (salt None) or one salt's; returns how many went."""
        keys = [k for k, (s, _) in self._rows.items() if salt is None or s == salt]
        for key in keys:
            self._drop(key)
        return len(keys)

    def _drop(self, key: bytes) -> None:
        entry = self._rows.pop(key, None)
        if entry is not None:
            self._bytes -= entry[1].numel() * entry[1].element_size()

    def stats(self) -> PromptLogitsStats:
        return PromptLogitsStats(len(self._rows), self._bytes, self.hits, self.stored)
