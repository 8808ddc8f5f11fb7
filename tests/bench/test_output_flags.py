"""Every `asynchicache bench` subcommand reports the same way: `--json` (stdout is the one
JSON report) and `--out DIR` (the report kept there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asynchicache.bench.micro import micro
from asynchicache.cli import BENCHMARKS

OURS = sorted(set(BENCHMARKS) - {"vllm"})  # vllm's CLI belongs to the vLLM integration


@pytest.mark.parametrize("command", OURS)
def test_each_subcommand_offers_json_and_out_dir(command: str) -> None:
    argv = [sys.executable, "-m", "asynchicache", "bench", command, "--help"]
    help_text = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "--json" in help_text and "--out DIR" in help_text, help_text


def test_micro_prints_and_keeps_the_same_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--json", "--out", str(tmp_path / "out"), "--only", "radix",
        "--requests", "4", "--request-tokens", "64", "--prefix-tokens", "32", "--rounds", "1",
    ]  # fmt: skip
    assert micro.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    kept = json.loads((tmp_path / "out" / "micro.json").read_text())
    assert printed == kept and printed["radix_match_ms_per_req"] > 0


def test_micro_without_json_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--only", "radix", "--requests", "4", "--request-tokens", "64", "--rounds", "1"]
    assert micro.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("radix_match_ms_per_req ") for line in lines)
