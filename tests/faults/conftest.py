"""Fixtures of the fault matrix: one live server on a disk folder, prompts and their
cold greedy answers (see fault_helpers for the scale knobs)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fault_helpers import Matrix, knob
from live_server import LiveServer
from traffic import make_prompts, references

from asynchicache.launch.frontend import Frontend
from asynchicache.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def tok(frontend: Frontend) -> Tokenizer:
    return frontend.tokenizer


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory, tok: Tokenizer) -> Iterator[Matrix]:
    root = tmp_path_factory.mktemp("faults")
    # Every load reads its chain to the end: under best_effort a busy machine gives up
    # late disk loads, so a damaged page might never be read (nor removed) by the
    # corruption test, and the next test would find it on disk.
    wait = ("--prefetch-policy", "wait_complete")
    server = LiveServer(root / "kv", root / "server.log", *wait).start()
    state = Matrix(root, tok, server, make_prompts(tok, "s", knob("prompts")), {})
    try:
        state.expected = references(server.url, state.prompts, knob("clients"))
        yield state
    finally:
        state.server.shutdown()
