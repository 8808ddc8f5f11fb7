"""Child processes: titled, restarted when allowed, stopped for good, never orphaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from processes import pid_alive
from supervised_targets import ignore_sigterm, sleep_forever, sleep_with_env

from asynchicache.launch.openmp import OPENMP_WAIT, openmp_env
from asynchicache.launch.supervisor import ChildSpec, Supervisor

SUPPORT = Path(__file__).resolve().parents[1] / "support"


def _pids(pid_file: Path, n: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid_file.exists():
            pids = [int(x) for x in pid_file.read_text().split()]
            if len(pids) >= n:
                return pids
        time.sleep(0.05)
    raise AssertionError(f"expected {n} pids in {pid_file}")


def _wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_restart_title_and_stop(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    sup = Supervisor()
    sup.start(ChildSpec("cache-service", sleep_forever, pid_file, restart=True))
    (first,) = _pids(pid_file, 1)
    cmdline = Path(f"/proc/{first}/cmdline").read_bytes().replace(b"\0", b" ")
    assert b"asynchicache: cache-service" in cmdline
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while len(_pids(pid_file, 1)) < 2 and time.monotonic() < deadline:
        assert sup.check() is None  # restartable: never reported as fatal
        time.sleep(0.05)
    second = _pids(pid_file, 2)[1]
    assert second != first and sup.children["cache-service"].restarts == 1
    pids = sup.stop_all(timeout_s=5)
    assert set(pids) == {first, second}
    assert _wait_dead(second)


def test_a_child_that_may_not_restart_is_reported(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    sup = Supervisor()
    sup.start(ChildSpec("engine", sleep_forever, pid_file))
    (pid,) = _pids(pid_file, 1)
    os.kill(pid, signal.SIGKILL)
    sup.children["engine"].process.join(5)  # type: ignore[union-attr]
    assert sup.check() == "engine"
    sup.stop_all(timeout_s=1)


def test_sigterm_ignored_means_sigkill(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    sup = Supervisor()
    sup.start(ChildSpec("engine", ignore_sigterm, pid_file))
    (pid,) = _pids(pid_file, 1)
    t0 = time.monotonic()
    sup.stop_all(timeout_s=0.5)
    assert _wait_dead(pid, 5)
    assert time.monotonic() - t0 < 10


def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SUPPORT), str(SUPPORT.parents[1])])}
    parent = subprocess.Popen(
        [sys.executable, str(SUPPORT / "supervised_targets.py"), str(pid_file)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None and "child started" in parent.stdout.readline()
        (child,) = _pids(pid_file, 1)
        parent.kill()  # no cleanup code runs in the parent
        parent.wait(5)
        assert _wait_dead(child), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()


def test_a_childs_env_is_set_from_its_start_and_the_parents_is_left_alone(
    tmp_path: Path,
) -> None:
    """OpenMP reads its wait policy as it loads: the engine child gets it in its environment
    at spawn (launch/openmp.py), and the launcher's own environment does not change."""
    pid_file = tmp_path / "pids"
    before = os.environ.get("OMP_WAIT_POLICY")
    sup = Supervisor()
    sup.start(ChildSpec("engine", sleep_with_env, pid_file, env=openmp_env({})))
    _pids(pid_file, 1)
    assert pid_file.with_suffix(".env").read_text() == dict(OPENMP_WAIT)["OMP_WAIT_POLICY"]
    assert os.environ.get("OMP_WAIT_POLICY") == before
    sup.stop_all(timeout_s=5)


def test_an_operators_openmp_setting_is_kept() -> None:
    assert openmp_env({}) == OPENMP_WAIT
    assert openmp_env({"OMP_WAIT_POLICY": "ACTIVE"}) == ()
    assert openmp_env({"GOMP_SPINCOUNT": "1000"}) == ()
