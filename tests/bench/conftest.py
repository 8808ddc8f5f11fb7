"""Fixtures for the serving benchmark tests: the real tokenizer, a scripted OpenAI server."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from bench_helpers import ScriptedServer

from asynchicache.launch.frontend import Frontend
from asynchicache.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer(frontend: Frontend) -> Tokenizer:
    """The default model's (`load_tokenizer(None)`'s), from the suite's one frontend."""
    return frontend.tokenizer


@pytest.fixture
def scripted_server() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def sigterm_kept() -> Iterator[None]:
    """For tests that call a bench `main` in this process: it turns SIGTERM into SystemExit
    (to stop its servers); this process gets its own handler back."""
    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)
