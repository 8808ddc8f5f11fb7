"""Counting the engine's give-ups on loads from a server log (lines as the engine writes them)."""

from __future__ import annotations

from pathlib import Path

from asynchicache.bench.processes.server_log import load_events, read_load_events
from asynchicache.bench.reports.report import markdown

LOG = """\
2026-11-29 16:48:50 engine INFO engine ready: model SmolLM2-135M-Instruct on cpu
2026-11-29 16:49:10 engine INFO load for chatcmpl-1a is late; recomputing past its L1 prefix
2026-11-29 16:49:12 engine INFO load for chatcmpl-2b fell short (storage delivered 0 of 115 \
pages: timeout); recomputing the rest
2026-11-29 16:49:13 engine INFO load for chatcmpl-3c fell short (storage delivered 0 of 87 \
pages: timeout); recomputing the rest
2026-11-29 16:49:14 engine INFO load for chatcmpl-4d fell short (no L2 room for the storage \
pages); recomputing the rest
2026-11-29 16:49:15 engine WARNING store of 12 pages: 3 persisted (disk full)
"""


def test_counts_and_groups_reasons() -> None:
    ev = load_events(LOG)
    assert (ev["late_loads"], ev["short_loads"], ev["failed_stores"]) == (1, 3, 1)
    assert ev["reasons"] == {
        "storage delivered N of N pages: timeout": 2,
        "no L2 room for the storage pages": 1,
        "store: disk full": 1,
    }
    assert next(iter(ev["reasons"])).startswith("storage delivered")  # most frequent first


def test_missing_log_and_quiet_log(tmp_path: Path) -> None:
    quiet = {"late_loads": 0, "short_loads": 0, "failed_stores": 0, "reasons": {}}
    assert read_load_events(tmp_path / "none.log") == quiet
    (tmp_path / "s.log").write_text(LOG.splitlines()[0] + "\n")
    assert read_load_events(tmp_path / "s.log") == quiet


def test_report_names_the_setup_that_recomputed() -> None:
    config = {
        "setup": "l1-l2-l3",
        "mean_ttft_s": 1.0,
        "p50_ttft_s": 1.0,
        "p90_ttft_s": 1.0,
        "p99_ttft_s": 1.0,
        "hit_rate": 0.5,
        "ideal_hit_rate": 0.6,
        "hit_rate_by_tier": {"disk": 0.5},
        "requests_per_s": 1.0,
        "total_tokens_per_s": 1.0,
        "requests": 1,
        "errors": 0,
        "load_events": load_events(LOG),
    }
    summary = {
        "workload": "longdoc",
        "seed": 0,
        "scale": 1.0,
        "requests": 1,
        "date": "d",
        "sizing": {
            "working_set_tokens": 1,
            "working_set_over_l1": 4.0,
            "device_cache_tokens": 1,
            "host_cache_tokens": 2,
            "page_size": 16,
        },
        "configs": {"L1+L2+L3": config},
    }
    text = markdown(summary)
    assert "- L1+L2+L3: 1 loads given up as late, 3 short loads, 1 failed stores" in text
    assert '2x "storage delivered N of N pages: timeout", 1x "no L2 room' in text
