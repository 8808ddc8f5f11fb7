"""What `serve` stops with for a command line, without starting anything."""

from __future__ import annotations

import contextlib
import io


def serve_refusal(*argv: str) -> str | None:
    """The error `serve --device cpu ARGV` stops with (None: it would have started).

    A flag the parser refuses exits with its message on stderr; a value the configs
    refuse raises ValueError (serve's main turns it into parser.error, exit 2)."""
    from asynchicache.launch.options import parse_args, to_config

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            to_config(parse_args(["--device", "cpu", *argv]))
        except SystemExit:
            return err.getvalue()
        except ValueError as exc:
            return str(exc)
    return None
