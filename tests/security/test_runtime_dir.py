"""Issue 39, finding 12: the runtime folder of the cache service's socket.

Its default path (`$XDG_RUNTIME_DIR/asynchicache-<uid>`, else under the temp dir) is
predictable, so another local user may make it first. It is used only when it is a
real folder (not a symlink, which its owner could point elsewhere at any time) of
this user's, private (0700); anything else is refused with an error that says why,
before a socket or a lock file goes there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from asynchicache.integrations.vllm.l2.service_process import lock_path
from asynchicache.storage.service.service_config import (
    ServiceConfig,
    default_runtime_dir,
    prepare_address,
    prepare_runtime_dir,
)

NOBODY = 65534


def _runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return default_runtime_dir()


def test_a_fresh_runtime_folder_is_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _runtime_dir(tmp_path, monkeypatch)
    prepare_address(ServiceConfig(tmp_path / "kv").address)
    st = os.lstat(folder)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()


def test_a_symlink_planted_at_the_runtime_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link to a private folder of ours passes every check made through it (owner,
    mode), but whoever planted it can re-point it at their own folder once it passed."""
    folder = _runtime_dir(tmp_path, monkeypatch)
    target = tmp_path / "ours"
    target.mkdir(mode=0o700)
    folder.symlink_to(target)
    with pytest.raises(PermissionError, match="symlink"):
        prepare_address(ServiceConfig(tmp_path / "kv").address)
    assert list(target.iterdir()) == []


def test_a_dangling_symlink_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _runtime_dir(tmp_path, monkeypatch)
    folder.symlink_to(tmp_path / "not-yet")
    with pytest.raises(PermissionError, match="symlink"):
        prepare_address(ServiceConfig(tmp_path / "kv").address)
    assert not (tmp_path / "not-yet").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder another user's needs root")
def test_a_runtime_folder_made_first_by_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _runtime_dir(tmp_path, monkeypatch)
    folder.mkdir(mode=0o700)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"uid {NOBODY}"):
        prepare_address(ServiceConfig(tmp_path / "kv").address)
    with pytest.raises(PermissionError):  # the vLLM launcher's lock files go there too
        prepare_runtime_dir(lock_path("tcp://127.0.0.1:5555").parent)


def test_a_runtime_folder_others_may_enter_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _runtime_dir(tmp_path, monkeypatch)
    folder.mkdir()
    os.chmod(folder, 0o755)
    with pytest.raises(PermissionError, match="0755"):
        prepare_address(ServiceConfig(tmp_path / "kv").address)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755  # not ours to change
