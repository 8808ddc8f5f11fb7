"""Suite-wide fixtures and checks: no shared-memory segment of ours outlives the tests
(tests/support/shm_leftovers.py; tests/vllm/conftest.py checks vLLM's too); a
strict page ledger; `make_pool` for the tests that build L2 pools; transformers' SmolLM2,
loaded once for every test that checks the default model against it; the default
model itself (`smollm`) and its frontend (`frontend`), loaded once too.

Every process the run starts is stopped when the run ends, even a killed one
(tests/support/reaper.py), and timeouts follow this host's measured speed
(tests/support/host_speed.py: one calibration per run, at the first timeout that needs
it; the figure is printed at the end)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import reaper
import torch
from hf_reference import hf_model
from host_speed import SLOWDOWN_ENV, scaled
from last_user import stop_finished
from pools import Pool, pool_factory
from shm_leftovers import snapshot, wait_no_leftovers

from asynchicache.hierarchy.l2.ledger import STRICT_ENV
from asynchicache.model.op_choice import RECORD_DIR_ENV

if TYPE_CHECKING:  # imported by the fixtures that need them (this file is loaded by every run)
    from asynchicache.launch.frontend import Frontend
    from asynchicache.model.loader import LoadedModel

# Before anything starts a process: the run's token, inherited by all it starts, and the
# watcher that stops them when this process ends in any way.
reaper.start()

# An illegal page or slot transition raises in every cache the tests build, in
# this process and in the servers it starts (production only counts and logs it).
os.environ.setdefault(STRICT_ENV, "1")

# Ours or torch's per op (model/op_choice.py) is measured and recorded once per
# host: in a folder of this run's, never the host's record (cores busy with tests measure
# noise, and the record would name a developer's server's pages afterwards).
os.environ.setdefault(RECORD_DIR_ENV, tempfile.mkdtemp(prefix="asynchicache-op-choice-"))

# The models this process runs (in-process engines, transformers' references) compute on
# one torch thread: the process shares two cores with the servers it starts and, in
# `make test`, with tests/vllm, and on busy cores torch's second OpenMP thread mostly
# spins at barriers: an in-process 12-token generate took 5-9 CPU-s on two threads and
# 0.5-0.6 on one (the servers' engines have their own policy, engine/threads.py).
# The vLLM venv's pytest (tests/vllm) keeps torch's default: its owner's call.
if importlib.util.find_spec("vllm.entrypoints") is None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_segments() -> Iterator[None]:
    before = snapshot()
    yield
    leaked = wait_no_leftovers(before, multiprocessing=False)
    assert not leaked, f"shared-memory segments leaked by the test suite: {leaked}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """After each test's teardown, stop the shared servers it was the last user of
    (tests/support/last_user.py)."""
    try:
        return (yield)
    finally:
        stop_finished(item)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """A test's pytest-timeout (its mark, else the ini's) scaled to this host's speed, set
    before pytest-timeout's own wrapper reads it (tests/support/host_speed.py)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        kwargs = dict(marker.kwargs)
        base = marker.args[0] if marker.args else kwargs.pop("timeout")
        args = marker.args[1:]
    else:
        base, args, kwargs = item.config.getini("timeout") or 0, (), {}
    if base and float(base) > 0:
        item.add_marker(pytest.mark.timeout(scaled(float(base)), *args, **kwargs), append=False)
    yield


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The host's slowdown against the reference host, where a test measured it."""
    if os.environ.get(SLOWDOWN_ENV):
        terminalreporter.write_line(
            f"host slowdown (timeouts scaled by it): {os.environ[SLOWDOWN_ENV]}"
        )


@pytest.fixture
def make_pool() -> Iterator[Callable[..., Pool]]:
    """`make_pool(slots, layout=SMALL, fill=0, seed=0)`: real shared-memory pools (the first
    `fill` slots random pages), closed after the test."""
    yield from pool_factory()


@pytest.fixture(scope="session")
def frontend() -> Frontend:
    """The default model's frontend (its tokenizer and config, read from the GGUF: ~2 s),
    read once for every folder's tests."""
    from asynchicache.launch.frontend import load_frontend

    return load_frontend(None)


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """The default SmolLM2 model, loaded once (~2.5 CPU-s) for every in-process engine."""
    from asynchicache.model.loader import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def hf_smollm() -> Any:
    """transformers' model of the default SmolLM2 GGUF in float32 (the reference); loading
    it takes ~10 s, so the suite loads it once."""
    from asynchicache.model.loader import default_model_path

    return hf_model(default_model_path())
