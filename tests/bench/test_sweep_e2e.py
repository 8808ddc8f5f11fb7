"""`asynchicache bench sweep` end to end: real servers, a tiny workload, all outputs checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asynchicache.bench import sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("sigterm_kept")]

KEYS = {"mean_ttft_s", "p90_ttft_s", "hit_rate", "ideal_hit_rate", "hit_rate_by_tier"}
TINY = [
    "--scale",
    "0.05",
    "--set",
    "users=2",
    "--set",
    "rounds=2",
    "--set",
    "max_tokens=2",
    "--set",
    "rate=20",
    "--no-progress",
]


def _sweep(out: Path, *args: str) -> int:
    """`asynchicache bench sweep` in this process (the `python -m asynchicache bench`
    dispatch is test_output_flags'): one interpreter start and import fewer per run."""
    return sweep.main(["--out", str(out), "--work-dir", str(out / "disk"), *args])


def test_sweep_multiturn_every_setup(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    assert _sweep(out, "--workload", "multiturn", *TINY) == 0
    summary = json.loads((out / "summary.json").read_text())
    names = ["no prefix cache", "L1", "L1+L2", "L1+L2+L3"]
    assert list(summary["configs"]) == names and summary["failed"] == {}
    for name in names:
        c = summary["configs"][name]
        assert set(c) >= KEYS, name
        assert c["errors"] == 0 and c["requests"] == 4
        assert c["mean_ttft_s"] > 0 and c["p90_ttft_s"] >= c["p50_ttft_s"]
        assert c["ideal"]["prompt_length_mismatches"] == 0  # our tokenization = the server's
        assert 0 < c["ideal_hit_rate"] < 1
    assert summary["configs"]["no prefix cache"]["hit_rate"] == 0
    # Round 2 of each user finds its round 1 in the cache.
    assert summary["configs"]["L1+L2+L3"]["hit_rate"] > 0
    assert summary["sizing"]["device_cache_tokens"] >= summary["sizing"]["largest_request_tokens"]
    for png in ("ttft.png", "tokens_by_tier.png", "throughput.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert "| L1+L2+L3 |" in (out / "table.md").read_text()
    assert (out / "l1" / "results.jsonl").read_text().count("\n") == 4
    assert "cache" in json.loads((out / "l1-l2-l3" / "cache_stats.json").read_text())
    assert not list((out / "disk").iterdir())  # disk folders removed


def test_sweep_restart_serves_from_disk_after_the_restart(tmp_path: Path) -> None:
    out = tmp_path / "restart"
    code = _sweep(
        out,
        "--workload",
        "restart",
        "--restart-of",
        "sysprompt",
        "--setups",
        "l1-l2-l3",
        "--scale",
        "0.05",
        "--set",
        "requests=3",
        "--set",
        "prompts=1",
        "--set",
        "max_tokens=2",
        "--set",
        "rate=20",
        "--set",
        "system_tokens=400",
        "--no-progress",
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    after = summary["configs"]["L1+L2+L3"]
    before = summary["before_restart"]["L1+L2+L3"]
    # After the restart the one long system prompt comes from disk for the first request.
    assert after["hit_rate_by_tier"]["disk"] > 0
    assert after["ideal_hit_rate"] > before["ideal_hit_rate"]
    assert (out / "l1-l2-l3" / "before-restart" / "results.jsonl").exists()
