"""One live `asynchicache serve --api-key KEY --admin-api-key ADMIN_KEY` with a disk tier,
shared by the security tests that need a real server (started on first use, stopped after
its last user); its keys are in keyed_server.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from keyed_server import ADMIN_KEY, KEY
from last_user import stop_after_last_user
from live_server import LiveServer


@pytest.fixture(scope="session")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("security")


@pytest.fixture(scope="session")
def server(request: pytest.FixtureRequest, root: Path) -> Iterator[LiveServer]:
    """Stopped after the last security test that uses it (an idle server costs CPU)."""
    srv = LiveServer(root / "kv", root / "server.log", "--admin-api-key", ADMIN_KEY,
                     api_key=KEY).start()  # fmt: skip
    stop_after_last_user(request, Path(__file__).parent, srv.shutdown)
    try:
        yield srv
    finally:
        srv.shutdown()
