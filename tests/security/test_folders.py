"""Issue 22, finding 6: the disk cache folder.

* an existing folder's mode is never changed (a shared 1777 folder once lost its mode
  and sticky bit to `--disk-cache-dir`);
* a disk folder group or others may write (sticky or not), or another user's, is
  refused with an error that names the flag and says what to do, by `serve` before
  anything starts and by the disk tier itself;
* every folder asynchicache makes is 0700, its missing parents too, whatever the umask;
  a new folder inside a sticky shared one (/tmp) is fine.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_refusal import serve_refusal

from asynchicache.common.keys import Namespace
from asynchicache.storage.base import PageLayout
from asynchicache.storage.disk.disk_backend import DiskBackend, DiskConfig
from asynchicache.storage.service.server import prepare_address

LAYOUT = PageLayout("float32", (2, 2, 4, 2, 8))
NS = Namespace("folders", "float32", 4)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _open(root: Path) -> DiskBackend:
    return DiskBackend(DiskConfig(root, NS.encode(), LAYOUT, 10**8, io_threads=1))


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _folder(path: Path, mode: int) -> Path:
    path.mkdir()
    os.chmod(path, mode)
    return path


def _serve_refusal(folder: Path) -> str | None:
    """What `serve --disk-cache-dir folder` stops with (None: it would have started)."""
    return serve_refusal("--disk-cache-dir", str(folder))


def test_an_existing_private_enough_folder_keeps_its_mode(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "kv", 0o755)
    _open(folder).close()
    assert _mode(folder) == 0o755


@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o775, 0o757, 0o1770])
def test_a_folder_others_may_write_is_refused_and_left_alone(tmp_path: Path, mode: int) -> None:
    folder = _folder(tmp_path / "shared", mode)
    with pytest.raises(ValueError, match=r"--disk-cache-dir .*writable by") as info:
        _open(folder).close()
    assert "chmod go-w" in str(info.value)
    assert _mode(folder) == mode  # sticky bit and all
    assert list(folder.iterdir()) == []  # nothing written into it either


@pytest.mark.parametrize("mode", [0o1777, 0o775])
def test_serve_refuses_such_a_folder_before_starting(tmp_path: Path, mode: int) -> None:
    folder = _folder(tmp_path / "shared", mode)
    message = _serve_refusal(folder)
    assert message is not None and "--disk-cache-dir" in message and "writable by" in message
    assert _mode(folder) == mode


def test_serve_accepts_a_new_folder_and_a_private_one(tmp_path: Path) -> None:
    assert _serve_refusal(tmp_path / "new" / "kv") is None
    assert _serve_refusal(_folder(tmp_path / "mine", 0o700)) is None
    assert not (tmp_path / "new").exists()  # checking makes nothing


@pytest.mark.skipif(os.getuid() != 0, reason="handing a folder to another user needs root")
def test_another_users_folder_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "theirs", 0o755)
    os.chown(folder, 65534, 65534)
    with pytest.raises(ValueError, match="belongs to uid 65534"):
        _open(folder).close()


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_new_folders_and_their_new_parents_are_0700(tmp_path: Path, mask: int) -> None:
    root = tmp_path / "a" / "b" / "kv"
    with _umask(mask):
        _open(root).close()
    for folder in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert _mode(folder) == 0o700, folder
    assert _mode(tmp_path) == 0o700  # pytest's own: it existed, untouched either way


def test_a_new_folder_inside_a_sticky_shared_one_is_fine(tmp_path: Path) -> None:
    """The default ~/.cache path and /tmp-like parents: only the cache folder itself counts."""
    shared = _folder(tmp_path / "tmp", 0o1777)
    with _umask(0o022):
        _open(shared / "asynchicache" / "kv").close()
    assert _mode(shared) == 0o1777
    assert _mode(shared / "asynchicache") == 0o700
    assert _mode(shared / "asynchicache" / "kv") == 0o700


def test_the_default_folder_under_a_fresh_cache_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asynchicache.settings.config import default_disk_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))
    root = default_disk_cache_dir()
    assert _serve_refusal(root) is None
    _open(root).close()
    assert _mode(tmp_path / "home" / ".cache") == 0o700 and _mode(root) == 0o700


def test_a_socket_folder_that_exists_keeps_its_mode(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "run", 0o755)
    with pytest.raises(PermissionError, match="private"):
        prepare_address(f"ipc://{folder}/cache.sock")
    assert _mode(folder) == 0o755
