"""Fixtures for the serving benchmark tests: the real tokenizer, a scripted OpenAI server."""

from __future__ import annotations

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
