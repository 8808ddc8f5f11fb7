"""The fault tests' own machinery: scale knobs, the shared server of the matrix, page
files on disk, and the fault record. The live server and the load live in
tests/support (live_server.py, traffic.py), shared with the fuzz and security tests.

Scale: `FAULTS_SCALE=ci` (default, a few minutes for the whole matrix) or `full`
(scripts/faults-full.sh); every knob can also be set alone, e.g.
`FAULTS_SERVICE_KILLS=30`. With `FAULTS_REPORT=path.jsonl` each scenario appends
its figures there (the full script turns them into a table); with
`FAULTS_KEEP_DIR=path` the chaos test leaves its disk folder there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from live_server import LiveServer
from traffic import Prompt

from asynchicache.model.tokenizer import Tokenizer
from asynchicache.storage.disk.disk_admin import verify_folder
from asynchicache.storage.header import decode_header, peek_header_len

_CI = {
    "service_kills": 2,  # a fresh service, then the one that replaced it (full form: 20)
    "kill_gap_s": 1,  # after the new service served requests (a readiness signal)
    "corruptions": 10,
    "prompts": 16,
    "clients": 3,
    "heavy_prompts": 9,
    "disk_full_prompts": 4,  # 44 pages: more than the 24-MB tmpfs (or the cap) holds
    "redis_prompts": 2,  # per phase (up, down, back): cold prompts whose pages are stored
    "phase_s": 5,
    "chaos_pauses": 10,  # per target (the cache service, then redis-server)
    "chaos_pause_max_ms": 2000,  # pauses last 1 s to this
    "chaos_prompts": 6,
    "chaos_restart": 0,  # ask every prompt again after a restart (hits from disk/Redis)
    "chaos_sample": 0,  # pages deep-verified afterwards (0: every page)
}
_FULL = {
    "service_kills": 20,
    "kill_gap_s": 12,  # > the supervisor's stable_s: each kill is a fresh crash, not a loop
    "corruptions": 60,
    "prompts": 32,
    "clients": 4,
    "heavy_prompts": 40,
    "disk_full_prompts": 30,
    "redis_prompts": 16,
    "phase_s": 30,
    "chaos_pauses": 40,
    "chaos_pause_max_ms": 3000,
    "chaos_prompts": 16,
    "chaos_restart": 1,
    "chaos_sample": 0,
}


def scale() -> str:
    return os.environ.get("FAULTS_SCALE", "ci")


def knob(name: str) -> int:
    """A fault-matrix size: `FAULTS_<NAME>` if set, else the value for the current scale."""
    env = os.environ.get(f"FAULTS_{name.upper()}")
    if env is not None:
        return int(env)
    return (_FULL if scale() == "full" else _CI)[name]


@dataclass
class Matrix:
    """The server under test (replaced when a test restarts it) and what it must answer."""

    root: Path
    tok: Tokenizer
    server: LiveServer
    prompts: list[Prompt]
    expected: dict[str, str]

    @property
    def disk(self) -> Path:
        assert self.server.disk_dir is not None
        return self.server.disk_dir


# --------------------------------------------------------------------------- disk files


def page_files(disk_dir: Path) -> list[Path]:
    return sorted(p for p in disk_dir.rglob("*.kv") if not p.name.startswith("."))


def temp_files(disk_dir: Path) -> list[Path]:
    return sorted(disk_dir.rglob(".tmp-*"))


def page_tokens(path: Path) -> tuple[int, ...] | None:
    """The token ids a page file's header names (None when the header does not parse)."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
        return decode_header(head[: peek_header_len(head)]).tokens
    except (OSError, ValueError):
        return None


def files_by_prompt(disk_dir: Path, prompts: Sequence[Prompt]) -> dict[str, list[Path]]:
    """prompt name -> its page files on disk (pages are matched by their token ids)."""
    owner = {}
    for p in prompts:
        for i, page in enumerate(p.pages):
            owner[(i, page)] = p.name
    by_tokens: dict[tuple[int, ...], list[str]] = {}
    for (_, page), name in owner.items():
        by_tokens.setdefault(page, []).append(name)
    out: dict[str, list[Path]] = {p.name: [] for p in prompts}
    for path in page_files(disk_dir):
        tokens = page_tokens(path)
        names = by_tokens.get(tokens or ())
        if names and len(names) == 1:  # a page only one prompt has
            out[names[0]].append(path)
    return out


def verify_disk(disk_dir: Path) -> int:
    """Bad page files under real names (checked the way a reader checks them; not removed);
    each one is printed with its problem, so a failure says which file and why."""
    report = verify_folder(disk_dir, remove=False)
    for line in report.bad_files:
        print(f"BAD PAGE FILE {line}")
    return report.bad


# --------------------------------------------------------------------------- the record


@dataclass
class FaultRecord:
    """One row of the fault matrix (docs/reliability.md)."""

    scenario: str
    faults_injected: int
    requests_served: int
    requests_failed: int
    wrong_outputs: int
    corrupt_detected: int | None = None  # None: not a corruption scenario
    corrupt_served: int | None = None
    seconds: float = 0.0
    notes: dict[str, object] = field(default_factory=dict)


def record(rec: FaultRecord) -> None:
    """Print the row (pytest -s shows it) and append it to $FAULTS_REPORT when set."""
    row = {"scale": scale(), **asdict(rec)}
    print("\nFAULT", json.dumps(row))
    path = os.environ.get("FAULTS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
