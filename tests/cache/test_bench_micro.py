"""`asynchicache bench micro` runs its sections on small sizes and reports the keys others read."""

from __future__ import annotations

import json

import pytest

from asynchicache.bench.micro import micro


def test_micro_reports_radix_and_copy_keys(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--json", "--only", "radix", "--only", "copy",
        "--requests", "10", "--request-tokens", "96", "--prefix-tokens", "64", "--rounds", "1",
        "--copy-mb", "4", "--copy-rounds", "1",
    ]  # fmt: skip
    assert micro.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    for key in (
        "radix_insert_ms_per_req",
        "radix_match_ms_per_req",
        "hicache_insert_ms_per_req",
        "l1_l2_copy_GBps",
        "torch_copy_GBps",
        "l2_l1_copy_GBps",
    ):
        assert isinstance(report[key], float) and report[key] > 0, key
    assert "disk_write_GBps" not in report  # --only skips other sections


def test_sections_are_registered_by_name() -> None:
    names = [s.name for s in micro.sections()]
    assert names[:2] == ["radix", "copy"]
    with pytest.raises(SystemExit):
        micro.build_parser(micro.sections()).parse_args(["--only", "nope"])
