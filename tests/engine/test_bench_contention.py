"""The contention benchmark runs end to end (tiny model, two loads) and prints its record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asynchicache.bench.micro.contention import main


def test_contention_times_both_steps_at_both_counts_under_each_load(
    tiny_checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tiny_checkpoints["llama3-rope-tied"])
    argv = ["--model", model, "--loads", "quiet,1 core", "--cached", "40", "--prefill", "64",
            "--repeats", "1"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["loads"]) == {"quiet", "1 core"}
    for times in report["loads"].values():
        assert set(times) == {"prefill_64@1", "prefill_64@2", "decode_8@1", "decode_8@2"}
        assert all(seconds > 0 for seconds in times.values())
    with pytest.raises(SystemExit, match="unknown loads"):
        main(["--loads", "3 cores"])
