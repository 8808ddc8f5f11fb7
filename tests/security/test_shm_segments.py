"""Issue 39, findings 8 (shm half) and 11: shared-memory segments and foreign names.

* `remove_stale_segments` survives any name another user can put in /dev/shm: a pid too
  large for `kill` (`asynchicache-99999999999-x` once made every `serve` fail with
  OverflowError), non-ASCII digits, a folder, another user's file, a symlink;
* `SharedSegment.attach` refuses a symlink (O_NOFOLLOW), a segment another user owns and a
  name that is not a plain segment name.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asynchicache.common.shm import SEGMENT_PREFIX, SharedSegment, owner_pid, remove_stale_segments

DEAD_PID = 4_194_304 + 1  # above Linux's largest pid_max: never alive


def test_owner_pid_ignores_names_kill_cannot_take() -> None:
    assert owner_pid(f"{SEGMENT_PREFIX}99999999999-x") is None
    assert owner_pid(f"{SEGMENT_PREFIX}{'9' * 40}-x") is None
    assert owner_pid(f"{SEGMENT_PREFIX}\u0663\u0664-x") is None  # Arabic-Indic digits
    assert owner_pid(f"{SEGMENT_PREFIX}0-x") is None  # kill(0) is the process group
    assert owner_pid(f"{SEGMENT_PREFIX}123-x") == 123


def test_stale_scan_survives_foreign_names(tmp_path: Path) -> None:
    for name in ("99999999999-x", "9" * 40, "\u0663\u0664-x", "-x", "", "abc"):
        (tmp_path / f"{SEGMENT_PREFIX}{name}").write_bytes(b"")
    (tmp_path / f"{SEGMENT_PREFIX}{DEAD_PID - 1}-dir").mkdir()  # a folder, "owner" dead
    foreign = tmp_path / f"{SEGMENT_PREFIX}{DEAD_PID - 2}-theirs"
    foreign.write_bytes(b"")
    os.chown(foreign, 12345, 12345)  # another user's file: not ours to remove
    target = tmp_path / "precious"
    target.write_bytes(b"keep")
    (tmp_path / f"{SEGMENT_PREFIX}{DEAD_PID - 3}-link").symlink_to(target)
    stale = tmp_path / f"{SEGMENT_PREFIX}{DEAD_PID - 4}-pool-00"
    stale.write_bytes(b"")

    removed = remove_stale_segments(tmp_path)

    assert stale.name in removed and not stale.exists()
    assert foreign.exists() and target.read_bytes() == b"keep"
    assert (tmp_path / f"{SEGMENT_PREFIX}{DEAD_PID - 1}-dir").is_dir()


def test_attach_refuses_a_symlink(tmp_path: Path) -> None:
    seg = SharedSegment.create(4096, tag="real", shm_dir=tmp_path)
    try:
        link = f"{SEGMENT_PREFIX}{os.getpid()}-link-00"
        (tmp_path / link).symlink_to(tmp_path / seg.name)
        with pytest.raises(OSError):
            SharedSegment.attach(link, shm_dir=tmp_path)
    finally:
        seg.close()
        (tmp_path / seg.name).unlink(missing_ok=True)


def test_attach_refuses_another_users_segment(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("making another user's file needs root")
    name = f"{SEGMENT_PREFIX}{os.getpid()}-theirs-00"
    path = tmp_path / name
    path.write_bytes(bytes(4096))
    os.chown(path, 12345, 12345)
    with pytest.raises(PermissionError, match="owned by uid 12345"):
        SharedSegment.attach(name, shm_dir=tmp_path)


@pytest.mark.parametrize("name", ["../etc/passwd", "/etc/passwd", "passwd", ".hidden", ""])
def test_attach_refuses_names_that_are_not_segments(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="segment name"):
        SharedSegment.attach(name, shm_dir=tmp_path)
