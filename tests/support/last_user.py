"""A session-scoped server stopped right after the last test that uses it, not at the end
of the session.

An idle `asynchicache serve` still costs ~2.5 CPU-s a minute (its engine's idle loop),
so a server shared by one folder's modules (fuzz/, security/) would otherwise idle
through every folder after its own. `stop_after_last_user(request, folder, stop)` in
a session-scoped fixture finds, among the tests of this run, the last one under `folder`
(the conftest's) that uses the fixture; `tests/conftest.py` calls
`stop_finished` after each test's teardown. The fixture's own teardown still stops the
server (a no-op by then) when the session ends early.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class _Stops:
    """Per session: the node id of a fixture's last user -> what stops its server."""

    after: dict[str, list[Callable[[], object]]] = field(default_factory=dict)


_KEY = pytest.StashKey[_Stops]()


def _users(session: pytest.Session, name: str, folder: Path) -> list[pytest.Item]:
    return [
        item
        for item in session.items
        if name in getattr(item, "fixturenames", ()) and item.path.is_relative_to(folder)
    ]


def stop_after_last_user(
    request: pytest.FixtureRequest, folder: Path, stop: Callable[[], object]
) -> None:
    """Call `stop` once the last test of this run under `folder` that uses `request`'s
    fixture (a session-scoped one, defined in `folder`'s conftest.py) is torn down."""
    users = _users(request.session, request.fixturename, folder.resolve())
    if not users:  # asked for by a plugin or by a test outside the folder: session end
        return
    stops = request.config.stash.setdefault(_KEY, _Stops())
    stops.after.setdefault(users[-1].nodeid, []).append(stop)


def stop_finished(item: pytest.Item) -> None:
    """After `item`'s teardown: stop the servers whose last user it was."""
    stops = item.config.stash.get(_KEY, None)
    if stops is None:
        return
    for stop in stops.after.pop(item.nodeid, []):
        stop()
