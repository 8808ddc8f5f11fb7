"""Small, fast regressions of bugs the fault runs found in other modules."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from supervised_targets import sleep_forever

from asynchicache.common.tiers import Tier
from asynchicache.hierarchy.radix import RadixTree
from asynchicache.launch.supervisor import MAX_BACKOFF_S, ChildSpec, Supervisor, backoff_s
from asynchicache.storage.base import PageLayout
from asynchicache.storage.header import HeaderError, PageHeader, decode_header, encode_header

PS = 4


def test_evicting_a_removed_leaf_still_offers_its_parent() -> None:
    """`/cache/clear` left L2 pages behind: a caller that removes the yielded leaf
    detached it, so its parent was never offered (radix.evictable)."""
    tree = RadixTree(PS, b"\0" * 16)
    tokens = list(range(4 * PS))
    tree.insert(tokens, [0, 1, 2, 3], Tier.HOST)
    tree.insert([*tokens[: 2 * PS], *range(100, 100 + 2 * PS)], [0, 1, 4, 5], Tier.HOST)
    dropped = []
    for node in tree.evictable(Tier.HOST):
        dropped.append((node.start_page, node.end_page))
        tree.remove_subtree(node)  # what the hierarchy does with a node that lives nowhere
    assert sorted(dropped) == [(0, 2), (2, 4), (2, 4)]
    assert list(tree.iter_nodes()) == []


def test_header_padding_is_checked() -> None:
    """A flipped byte in the zero padding of a header passed every check."""
    layout = PageLayout("float32", (2, 2, PS, 2, 8))
    header = PageHeader(b"ns", b"h" * 16, tuple(range(PS)), layout, layout.page_bytes, b"c" * 16)
    raw = bytearray(encode_header(header))
    assert decode_header(raw) == header
    raw[-100] ^= 0x40
    with pytest.raises(HeaderError, match="padding"):
        decode_header(raw)


def _pids(pid_file: Path, n: int) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = [int(x) for x in pid_file.read_text().split()] if pid_file.exists() else []
        if len(pids) >= n:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} starts")


def _kill_and_restart(sup: Supervisor, pid_file: Path, n: int) -> str | None:
    os.kill(_pids(pid_file, n)[-1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        dead = sup.check()
        if dead is not None:
            return dead
        if len(_pids(pid_file, n)) > n:
            return None
        time.sleep(0.05)
    raise AssertionError("neither restarted nor reported")


def test_crashes_after_stable_runs_do_not_exhaust_the_restarts(tmp_path: Path) -> None:
    """The launcher stopped the server on the 6th cache-service crash, however far apart."""
    pid_file = tmp_path / "pids"
    sup = Supervisor()
    sup.start(ChildSpec("cache-service", sleep_forever, pid_file, True, 2, stable_s=0.1))
    try:
        for n in range(1, 5):  # 4 crashes with max_restarts=2, each after a stable run
            _pids(pid_file, n)
            time.sleep(0.2)  # > stable_s since the start (the child wrote its pid after it)
            assert _kill_and_restart(sup, pid_file, n) is None
    finally:
        sup.stop_all(5)


def test_a_crash_loop_still_stops(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    sup = Supervisor()
    sup.start(ChildSpec("cache-service", sleep_forever, pid_file, True, 2, stable_s=60))
    try:
        verdicts = [_kill_and_restart(sup, pid_file, n) for n in range(1, 4)]
        assert verdicts == [None, None, "cache-service"]
    finally:
        sup.stop_all(5)


def test_a_child_without_a_restart_limit_is_never_given_up(tmp_path: Path) -> None:
    """Issue 39, finding 13: six crashes of the cache service in a row stopped the server.
    A child without a limit (the cache service) is restarted with back-off however often
    it dies in a row; `test_a_crash_loop_still_stops` holds for a limited one (the engine)."""
    pid_file = tmp_path / "pids"
    sup = Supervisor()
    sup.start(ChildSpec("cache-service", sleep_forever, pid_file, restart=True,
                        max_restarts=None, first_backoff_s=0.01))  # fmt: skip
    try:
        for n in range(1, 9):  # past the default limit of 5 crashes in a row
            assert _kill_and_restart(sup, pid_file, n) is None
        assert sup.children["cache-service"].restarts == 8
    finally:
        sup.stop_all(5)


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [backoff_s(n, 0.2) for n in range(4)] == [0.2, 0.4, 0.8, 1.6]
    assert backoff_s(10_000, 0.2) == MAX_BACKOFF_S  # no overflow after many crashes
