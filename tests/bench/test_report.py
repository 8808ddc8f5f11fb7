"""The sweep report: markdown table and PNG plots from a summary and its results files."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from asynchicache.bench.reports.report import config_table, markdown, write_report
from asynchicache.bench.reports.run_results import RequestResult, write_results

TIERS0 = {"device": 0.0, "host": 0.0, "disk": 0.0, "remote": 0.0}


def _config(slug: str, ttft: float, tiers: dict[str, float]) -> dict[str, Any]:
    by_tier = {**TIERS0, **tiers}
    return {
        "setup": slug,
        "mean_ttft_s": ttft,
        "p50_ttft_s": ttft,
        "p90_ttft_s": 2 * ttft,
        "p99_ttft_s": 3 * ttft,
        "hit_rate": sum(by_tier.values()),
        "ideal_hit_rate": 0.8,
        "hit_rate_by_tier": by_tier,
        "requests_per_s": 1 / ttft,
        "output_tokens_per_s": 10.0,
        "total_tokens_per_s": 300.0 / ttft,
        "requests": 4,
        "errors": 0,
        "preemptions": 1,
    }


def _summary() -> dict[str, Any]:
    return {
        "workload": "multiturn",
        "seed": 0,
        "scale": 1.0,
        "requests": 4,
        "date": "2026-01-01",
        "params": {"rate": 1.0},
        "sizing": {
            "working_set_tokens": 4000,
            "working_set_over_l1": 4.0,
            "device_cache_tokens": 1000,
            "host_cache_tokens": 2000,
            "page_size": 16,
        },
        "configs": {
            "no prefix cache": _config("no-cache", 4.0, {}),
            "L1": _config("l1", 2.0, {"device": 0.2}),
            "L1+L2+L3": _config("l1-l2-l3", 0.5, {"device": 0.2, "host": 0.1, "disk": 0.5}),
        },
        "failed": {"L1+L2": "Traceback...\nServerError: no /health answer"},
    }


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def test_write_report_makes_table_and_three_readable_pngs(tmp_path: Path) -> None:
    summary = _summary()
    for c in summary["configs"].values():
        rs = [
            RequestResult(i, i, 0, 0.0, 0.0, ttft_s=c["mean_ttft_s"] * (0.5 + i / 3))
            for i in range(4)
        ]
        write_results(tmp_path / c["setup"] / "results.jsonl", rs)
    written = write_report(tmp_path, summary)
    names = sorted(p.name for p in written)
    assert names == ["table.md", "throughput.png", "tokens_by_tier.png", "ttft.png"]
    for p in written:
        if p.suffix == ".png":
            width, height = _png_size(p)
            assert 600 <= width <= 1000 and 300 <= height <= 600
            assert p.stat().st_size < 150_000  # small enough to commit
    table = (tmp_path / "table.md").read_text()
    assert "| L1+L2+L3 | 0.50 |" in table and "0.25x" in table  # 0.5 s / 2.0 s
    assert "80.0%" in table and "L1+L2 failed" in table


def test_table_without_an_l1_row_has_no_ratio() -> None:
    configs = {"L1+L2+L3": _config("l1-l2-l3", 0.5, {"disk": 0.5})}
    row = config_table(configs).splitlines()[2]
    assert "| n/a |" in row and "50.0%" in row


def test_markdown_names_the_working_set() -> None:
    text = markdown(_summary())
    assert "Working set 4000 tokens" in text and "4.0x L1" in text


def test_table_shows_preemptions_per_request_and_storms() -> None:
    calm = {
        **_config("l1", 2.0, {}),
        "preemptions": 1,
        "preemptions_per_request": 0.01,
        "preemption_storm": False,
    }
    storm = {
        **_config("no-cache", 4.0, {}),
        "preemptions": 40,
        "preemptions_per_request": 0.4,
        "preemption_storm": True,
    }
    rows = config_table({"L1": calm, "no prefix cache": storm}).splitlines()
    assert "| 1 (0.010/req) |" in rows[2]
    assert "| 40 (0.400/req, STORM) |" in rows[3]
