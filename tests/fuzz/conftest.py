"""One live server for the HTTP fuzz tests of every module here (a start costs ~20 s).

`--max-model-len 48` bounds the work of the bodies that happen to be valid. Each
module ends by checking that it is still healthy with the processes it started
with (`first_pids`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from last_user import stop_after_last_user
from live_server import LiveServer


@pytest.fixture(scope="session")
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """Stopped after the last fuzz test that uses it (an idle server costs CPU)."""
    root = tmp_path_factory.mktemp("fuzz")
    srv = LiveServer(None, root / "server.log", "--max-model-len", "48").start()
    srv.first_pids = srv.pids()  # type: ignore[attr-defined]
    stop_after_last_user(request, Path(__file__).parent, srv.shutdown)
    try:
        yield srv
    finally:
        srv.shutdown()


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
