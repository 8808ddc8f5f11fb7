"""What the benchmark client measured for one request, and its JSON-lines file."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from asynchicache.common.tiers import TIERS


@dataclass(frozen=True)
class RequestResult:
    """One request: when it went out, its latencies (s) and where its prompt's KV came from.

    `ttft_s` runs from sending the request to the first streamed token text;
    `itl_s` are the gaps between later token chunks; `e2e_s` ends at the last
    byte of the stream. Offsets are from the start of the run.
    """

    index: int
    session: int
    turn: int
    scheduled_s: float
    sent_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    answer: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: str) -> RequestResult:
        raw = json.loads(line)
        raw["itl_s"] = tuple(raw.get("itl_s", ()))
        return cls(**raw)


def write_results(path: Path, results: Iterable[RequestResult]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in results:
            f.write(r.to_json() + "\n")


def read_results(path: Path) -> list[RequestResult]:
    return [RequestResult.from_json(line) for line in path.read_text().splitlines() if line]
