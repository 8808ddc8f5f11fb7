"""docs/migrating.md is what launch/migrating.py renders from the tables the server uses."""

from __future__ import annotations

from pathlib import Path

from asynchicache.launch.compat_flags import COMPAT_FLAGS
from asynchicache.launch.migrating import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"


def test_the_doc_matches_the_tables() -> None:
    assert DOC.read_text() == render(), (
        "docs/migrating.md is stale: python -m asynchicache.launch.migrating > docs/migrating.md"
    )


def test_every_flag_is_in_the_doc() -> None:
    text = DOC.read_text()
    assert all(row.name in text for row in COMPAT_FLAGS)
