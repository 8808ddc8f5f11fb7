"""Offline maintenance of a disk cache folder (`asynchicache cache stats|verify`;
`clear` is storage.service.offline_clear).

These work on the folder directly, for every namespace in it, without a
running service and without knowing the model: page files describe themselves.
A service running on the same folder at the same time stays correct (a page
removed under it is a counted miss), only its size accounting lags.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from asynchicache.storage.disk.disk_pins import PINS_DIR, load_pins
from asynchicache.storage.disk.folder import in_use
from asynchicache.storage.disk.names import (
    TMP_PREFIX,
    namespace_dir_name,
    parse_page_file_name,
)
from asynchicache.storage.disk.page_file import read_header
from asynchicache.storage.header import (
    HeaderError,
    PageHeader,
    decode_header,
    payload_checksum,
    peek_header_len,
)


@dataclass
class NamespaceReport:
    folder: str
    namespace: str = ""  # readable form of the namespace bytes, from a header
    pages: int = 0
    bytes: int = 0
    in_use: bool = False  # a live server leases it (its pages are not evicted for others)
    pins: int = 0  # unexpired pins (storage.disk.pins)
    pinned_pages: int = 0  # distinct pages they name


@dataclass
class FolderReport:
    """What a folder holds; `bad` lists damaged page files (removed when verifying)."""

    root: str
    namespaces: list[NamespaceReport] = field(default_factory=list)
    temp_files: int = 0
    bad: int = 0
    bad_files: list[str] = field(default_factory=list)

    @property
    def pages(self) -> int:
        return sum(n.pages for n in self.namespaces)

    @property
    def bytes(self) -> int:
        return sum(n.bytes for n in self.namespaces)


def _namespace_report(ns_dir: Path) -> NamespaceReport:
    """A namespace folder's report with its use and pins filled in (pages counted later)."""
    ns = NamespaceReport(ns_dir.name, in_use=in_use(ns_dir))
    pins = load_pins(ns_dir / PINS_DIR, time.time())
    ns.pins, ns.pinned_pages = len(pins), len({h for p in pins for h in p.pages})
    return ns


def _stored_pages(report: FolderReport) -> Iterator[tuple[NamespaceReport, Path, bytes]]:
    """Each page file under `report.root` with its namespace's report (appended to `report`)
    and its page hash; temp files are counted in `report`, other files passed over."""
    for ns_dir in namespace_dirs(Path(report.root)):
        ns = _namespace_report(ns_dir)
        report.namespaces.append(ns)
        for path in page_files(ns_dir):
            if path.name.startswith(TMP_PREFIX):
                report.temp_files += 1
            elif (page_hash := parse_page_file_name(path.name)) is not None:
                yield ns, path, page_hash


def _count_page(ns: NamespaceReport, path: Path) -> None:
    ns.pages += 1
    ns.bytes += _size(path)
    ns.namespace = ns.namespace or _readable_namespace(path)


def folder_stats(root: Path) -> FolderReport:
    """Pages and bytes per namespace (file sizes only: fast)."""
    report = FolderReport(str(root))
    for ns, path, _ in _stored_pages(report):
        _count_page(ns, path)
    return report


def verify_folder(root: Path, remove: bool = True) -> FolderReport:
    """Re-read every page file, check header and checksum; report (and remove) bad ones."""
    report = FolderReport(str(root))
    for ns, path, page_hash in _stored_pages(report):
        problem = check_page_file(path, page_hash, ns.folder)
        if problem is None:
            _count_page(ns, path)
            continue
        report.bad += 1
        report.bad_files.append(f"{path}: {problem}")
        if remove:
            path.unlink(missing_ok=True)
    return report


def check_page_file(path: Path, page_hash: bytes, ns_folder: str) -> str | None:
    """Everything a reader checks, for one file; the problem, or None when it is sound."""
    result = read_page_file(path, page_hash, ns_folder)
    return result if isinstance(result, str) else None


def read_page_file(
    path: Path, page_hash: bytes, ns_folder: str
) -> tuple[PageHeader, memoryview] | str:
    """A page file's header and verified payload, or the problem with it."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"unreadable: {exc}"
    try:
        header_len = peek_header_len(data)
        header = decode_header(data[:header_len])
    except HeaderError as exc:
        return f"bad header: {exc}"
    if header.page_hash != page_hash:
        return "page hash does not match the file name"
    if namespace_dir_name(header.namespace) != ns_folder:
        return "page of another namespace"
    if header.payload_len != header.layout.page_bytes:
        return f"payload length {header.payload_len} != layout's {header.layout.page_bytes}"
    if len(data) != header_len + header.payload_len:
        return f"size {len(data)} != {header_len + header.payload_len}"
    payload = memoryview(data)[header_len:]
    # Encrypted (--cache-encrypt): no checksum; only a reader holding the key checks the tag.
    if not header.encrypted and payload_checksum(payload) != header.payload_checksum:
        return "payload checksum mismatch"
    return header, payload


OLD_FORMAT = "page format of another version"


def read_page_header(path: Path) -> PageHeader | str:
    """A page file's header alone (one block read), or the problem with it (a problem
    starting with OLD_FORMAT: a file written by another version of the code)."""
    return read_header(path)  # an OldFormat problem starts with OLD_FORMAT


def namespace_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("ns-"))


def page_files(ns_dir: Path) -> list[Path]:
    out = []
    for sub in sorted(ns_dir.iterdir()):
        if sub.is_dir() and len(sub.name) == 2:
            out.extend(sorted(Path(e.path) for e in os.scandir(sub) if e.is_file()))
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _readable_namespace(path: Path) -> str:
    try:
        with path.open("rb") as f:
            head = f.read(4096)
        header = decode_header(head[: peek_header_len(head)])
    except (OSError, HeaderError):
        return ""
    return header.namespace.decode("utf-8", errors="replace").replace("\x1f", " | ")


def _rmdir_if_empty(path: Path) -> None:
    with contextlib.suppress(OSError):  # not empty: something else lives there
        path.rmdir()


def cache_command(action: str, root: Path, as_json: bool = False) -> int:
    """`asynchicache cache stats|verify`; exit status 1 when verify found damage."""
    report = verify_folder(root) if action == "verify" else folder_stats(root)
    print(json.dumps(_report_dict(report), indent=2) if as_json else _report_text(report, action))
    return 1 if report.bad else 0


def _report_dict(report: FolderReport) -> dict[str, object]:
    return {**asdict(report), "pages": report.pages, "bytes": report.bytes}


def _report_text(report: FolderReport, action: str) -> str:
    lines = [f"{report.root}: {report.pages} pages, {report.bytes / 1e9:.3f} GB"]
    for ns in report.namespaces:
        lines.append(
            f"  {ns.folder}  {ns.pages:8d} pages  {ns.bytes / 1e9:8.3f} GB  "
            f"{'in use' if ns.in_use else 'unused'}  {ns.namespace}"
        )
        if ns.pins:
            lines.append(f"      {ns.pins} pins, {ns.pinned_pages} pinned pages")
    if report.temp_files:
        lines.append(f"  {report.temp_files} temporary files (writes in progress or interrupted)")
    if action == "verify":
        lines.append(f"verified: {report.bad} bad page files removed")
        lines += [f"  {b}" for b in report.bad_files]
    return "\n".join(lines)
