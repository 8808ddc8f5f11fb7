"""What a server's log says about its cache loads: why some cached prefixes were recomputed.

The engine logs (INFO) every load it gave up on because it took longer than
recomputing ("is late") and every load that delivered fewer pages than asked
("fell short (<reason>)"), and (WARNING) every store to disk that failed.
A sweep counts them per setup, so a hit rate below the ideal comes with a cause.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

_LATE = re.compile(r"load for \S+ is late")
_SHORT = re.compile(r"load for \S+ fell short \((?P<why>.*)\); recomputing")
_STORE = re.compile(r"store of \d+ pages: \d+ persisted \((?P<why>.*)\)")
# Page counts and ids vary; the reason's words do not.
_NUMBERS = re.compile(r"\b\d+\b")


def _reason(text: str) -> str:
    return _NUMBERS.sub("N", text)


def load_events(log_text: str) -> dict[str, Any]:
    """Counts of late and short loads and failed stores, with their reasons."""
    reasons: Counter[str] = Counter()
    late = short = stores = 0
    for line in log_text.splitlines():
        if _LATE.search(line):
            late += 1
        elif m := _SHORT.search(line):
            short += 1
            reasons[_reason(m["why"])] += 1
        elif m := _STORE.search(line):
            stores += 1
            reasons["store: " + _reason(m["why"])] += 1
    return {
        "late_loads": late,
        "short_loads": short,
        "failed_stores": stores,
        "reasons": dict(reasons.most_common()),
    }


def read_load_events(path: Path) -> dict[str, Any]:
    try:
        return load_events(path.read_text(errors="replace"))
    except OSError:
        return load_events("")
