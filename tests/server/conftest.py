"""Fixtures for the HTTP layer: a fake engine process, a live server (the real tokenizer:
`frontend`, tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import ADMIN_KEY, API_KEY, ThreadServer

from asynchicache.launch.frontend import Frontend

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def fake_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    run_dir = tmp_path_factory.mktemp("run")
    env = {**os.environ, "PYTHONPATH": str(HERE.parent.parent)}
    proc = subprocess.Popen([sys.executable, str(HERE / "fake_engine.py"), str(run_dir)], env=env)
    try:
        yield run_dir
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


@pytest.fixture(scope="module")
def server(fake_engine: Path, frontend: Frontend) -> Iterator[ThreadServer]:
    with ThreadServer(fake_engine, frontend, API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def admin_server(fake_engine: Path, frontend: Frontend) -> Iterator[ThreadServer]:
    """`server` with an operator key (ADMIN_KEY) for the routes that drop or pin pages."""
    with ThreadServer(fake_engine, frontend, API_KEY, admin_api_key=ADMIN_KEY) as srv:
        yield srv
