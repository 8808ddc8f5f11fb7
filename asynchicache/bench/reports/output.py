"""How every `asynchicache bench` subcommand reports, the same way.

`--out DIR`: the run's JSON report is kept as a file in DIR (with whatever else the
benchmark writes there: logs, per-request results, plots). `--json`: stdout is that one
JSON object and nothing else (for scripts); without it, a view for people (a table, a
text report, or the headline figures).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def bench_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A subcommand's parser whose --help shows `doc` (its module docstring) as written."""
    return argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_output_arguments(
    parser: argparse.ArgumentParser, report_name: str, out_required: bool = False
) -> None:
    """`--json` and `--out DIR` (the report goes to DIR/`report_name`)."""
    parser.add_argument(
        "--json", action="store_true", help="print only the JSON report (one object) on stdout"
    )
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        required=out_required,
        help=f"folder for the outputs: the JSON report is DIR/{report_name}",
    )


def write_report(out: Path | None, report_name: str, report: Mapping[str, Any]) -> None:
    """`report` as DIR/`report_name` (nothing without --out)."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / report_name).write_text(json.dumps(report, indent=2) + "\n")


def print_report(args: argparse.Namespace, report: Mapping[str, Any], view: str | None) -> None:
    """The JSON report with --json (or when there is no `view`), else the view."""
    print(json.dumps(report) if args.json or view is None else view)
