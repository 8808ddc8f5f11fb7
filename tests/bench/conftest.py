"""Fixtures for the serving benchmark tests: the real tokenizer, a scripted OpenAI server."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from bench_helpers import ScriptedServer

from asynchicache.bench.prompts import load_tokenizer
from asynchicache.engine.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


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
