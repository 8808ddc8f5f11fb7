"""docs/migrating.md, generated from the tables the server uses, so the two cannot drift.

    python -m asynchicache.launch.migrating > docs/migrating.md

The flags come from launch/compat_flags.py, the endpoints from server/compat_routes.py,
the metric names from server/compat_metrics.py; tests/server/test_migrating_doc.py
fails when the file and `render()` differ.
"""

from __future__ import annotations

from collections.abc import Sequence

from asynchicache.launch.compat_flags import COMPAT_FLAGS, Kind, Peer
from asynchicache.server.compat_metrics import PEER_METRICS
from asynchicache.server.compat_routes import ENDPOINTS

INTRO = """\
# Migrating from SGLang HiCache, LightLLM and vLLM

Launch scripts, clients and dashboards written for those servers work here as they are,
as far as the meanings hold on this design; where one cannot, `serve` refuses it and
says what to do instead, listing every such flag of a launch line at once. This file is
generated from the tables the server itself uses (`python -m asynchicache.launch.migrating
> docs/migrating.md`); a test fails when they differ.

How their flags are read:

* **Their units.** SGLang's `--hicache-size` counts GB of 10^9 bytes; LightLLM's sizes
  count GiB, as ours do. `--hicache-ratio` sizes L2 as that many times the tokens of L1.
* **Their tiers.** SGLang's cache flags bring SGLang's tiers and defaults: L2 on, a
  ratio of 2.0, `write_through`, the `timeout` prefetch policy (1 s + 0.25 s per 1,024
  tokens), and L3 only with `--hicache-storage-backend`. LightLLM's bring LightLLM's: L2
  only with `--enable_cpu_cache` (2 GiB, 256-token pages), L3 only with
  `--enable_disk_cache` (10 GiB). Without them, our defaults hold (L2 2 GiB, L3 20 GiB).
* **One page size.** Every tier here shares `--page-size`, so LightLLM's
  `--cpu_cache_token_page_size` sets the page of L1 too.
* **L4 sits behind L3.** SGLang's `valkey`/`redis` backend becomes our Redis/Valkey tier,
  with an L3 folder in front of it (SGLang's file-backend folder, `/tmp/hicache`).
* **Conflicts are errors.** A peer's flag and one of ours (or another peer's) that set
  the same thing differently stop the launch; so do SGLang's and LightLLM's cache flags
  in one line.
* **Arrival prefetch.** As SGLang does, a request's L3/L4 prefix starts moving into L2
  when it arrives, not when it is admitted (`--no-arrival-prefetch` restores the latter).
"""

_SECTIONS = (
    ("SGLang HiCache", Peer.SGLANG, "SGLang"),
    ("LightLLM multi-level cache", Peer.LIGHTLLM, "LightLLM"),
    ("vLLM", None, "vLLM"),
    ("The seed's LightLLM hiradix flags", Peer.SEED, None),
)
_FLAG_NOTE = {
    Kind.MAPPED: "",
    Kind.SAME: "",
    Kind.IGNORED: "accepted, no effect (logged)",
    Kind.REFUSED: "refused",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(head: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _flags(peer: Peer) -> list[str]:
    rows = []
    for row in COMPAT_FLAGS:
        if row.peer is not peer:
            continue
        theirs = f"`${row.name}`" if row.is_env else f"`{row.flag}`"
        values = ", ".join(f"`{v}`" for v in row.accepts)
        if row.refuses:
            values += "; refused: " + ", ".join(f"`{v}`" for v in row.refuses)
        rows.append((theirs, _FLAG_NOTE[row.kind] or values, row.ours))
    refusals = [(f"`{row.flag} {v}`", why) for row in COMPAT_FLAGS if row.peer is peer
                for v, why in row.refuses.items()]  # fmt: skip
    out = ["### Flags", "", *_table(("theirs", "values / kind", "here"), rows), ""]
    if refusals:
        out += ["What a refused value says:", "", *_table(("theirs", "what we do instead"),
                                                          refusals), ""]  # fmt: skip
    return out


def _endpoints(peer: str) -> list[str]:
    rows = [(f"`{e.route}`", e.ours) for e in ENDPOINTS if e.peer == peer]
    return ["### Endpoints", "", *_table(("theirs", "here"), rows), ""] if rows else []


def _metrics(peer: str) -> list[str]:
    rows = [(f"`{m.name}`", m.kind, ", ".join(m.labels), m.ours)
            for m in PEER_METRICS if m.peer == peer]  # fmt: skip
    if not rows:
        return []
    head = ("theirs", "type", "labels", "counts here")
    return ["### Metrics", "", *_table(head, rows), ""]


def render() -> str:
    lines = [INTRO]
    for title, peer, name in _SECTIONS:
        lines += [f"## {title}", ""]
        if peer is not None:
            lines += _flags(peer)
        if name is not None:
            lines += _endpoints(name) + _metrics(name)
    lines += ["Our own metric names (`asynchicache_*`) are in docs/operations.md.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(), end="")
