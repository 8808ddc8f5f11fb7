"""One page file: reading it straight into an L2 slot and checking everything on the way.

A page file is `storage.header` (namespace, page hash, parent hash, token ids,
layout, payload length and checksum) followed by the page's bytes. A reader
trusts nothing: a file whose header does not parse, names another page,
namespace or layout, has the wrong length or fails its payload checksum is
a miss (the caller removes it), as is one whose keyed MAC does not verify when
the namespace has keys (storage.page_keys). With --cache-encrypt the payload
is read into a per-thread scratch buffer and decrypted into the slot
(storage.page_cipher). `PageFiles` holds what a
namespace's files must say; `check` is the header-only look taken at start-up.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from asynchicache.common.fileio import DIRECT_ALIGN, Scratch, clear_direct, preadv_all
from asynchicache.storage.base import PageLayout
from asynchicache.storage.header import (
    HeaderError,
    HeaderVersionError,
    PageHeader,
    body_buffer,
    decode_header,
    open_page,
    peek_header_len,
)
from asynchicache.storage.page_keys import NamespaceKeys


@dataclass(frozen=True)
class FileInfo:
    """What the header of a sound page file says (payload not read)."""

    page_hash: bytes
    size: int
    stamp_ns: int  # the file's mtime: its LRU stamp
    parent: bytes
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class PageFiles:
    """The page files of one namespace and layout."""

    namespace: bytes
    layout: PageLayout
    keys: NamespaceKeys | None = None  # --cache-key-file: every page must carry its MAC

    def problem(self, header: PageHeader, page_hash: bytes) -> str | None:
        """Why `header` is not the header of page `page_hash` here, or None."""
        return header.mismatch(self.namespace, self.layout, page_hash, "the file name")

    def check(self, path: Path, page_hash: bytes) -> FileInfo | str | None:
        """Header-only check: the file's info, why it is bad, or None when it is not there."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            return f"cannot open ({exc})"
        try:
            st = os.fstat(fd)
            head = os.pread(fd, DIRECT_ALIGN, 0)
            header_len = peek_header_len(memoryview(head))
            if header_len != DIRECT_ALIGN:
                head = os.pread(fd, header_len, 0)
            header = decode_header(memoryview(head))
        except (HeaderError, OSError) as exc:
            return f"bad header ({exc})"
        finally:
            os.close(fd)
        problem = self.problem(header, page_hash)
        if problem is None and st.st_size != header_len + header.payload_len:
            problem = f"file size {st.st_size} != {header_len + header.payload_len}"
        if problem is not None:
            return problem
        return FileInfo(page_hash, st.st_size, st.st_mtime_ns, header.parent, header.tokens)

    def read_into(
        self, fd: int, page_hash: bytes, dst: memoryview, direct: bool, scratch: Scratch
    ) -> tuple[int, PageHeader] | str:
        """Read an open file into `dst` and check everything; its size and header, or why
        it is bad."""
        head: bytearray | mmap.mmap
        # Encrypted: the ciphertext goes to this thread's (aligned) scratch, then into `dst`.
        body = body_buffer(self.keys, dst)
        if direct:
            # One aligned read of header block, payload and a probe for trailing bytes.
            head = scratch.head
            got = os.preadv(fd, [head, body, scratch.tail], 0)
        else:
            head = bytearray(DIRECT_ALIGN)
            got = preadv_all(fd, [memoryview(head), body, memoryview(bytearray(1))], 0)
        try:
            header_len = peek_header_len(memoryview(head))
            if header_len != DIRECT_ALIGN:  # a long header: rare, read it plainly
                if direct:
                    clear_direct(fd)
                head = bytearray(header_len)
                got = preadv_all(fd, [memoryview(head), body, memoryview(bytearray(1))], 0)
            header = decode_header(memoryview(head))
        except HeaderError as exc:
            return f"bad header ({exc})"
        problem = self.problem(header, page_hash)
        if problem is not None:
            return problem
        if got != header_len + header.payload_len:
            return f"length {got} != {header_len + header.payload_len} (truncated or padded)"
        return open_page(header, self.keys, body, dst) or (got, header)


class OldFormat(str):
    """The problem text of a page file written in another header format version."""


def read_header(path: Path) -> PageHeader | str:
    """A page file's header alone (one block read, any namespace), or the problem with it
    (an `OldFormat` for a file of another format version)."""
    try:
        with path.open("rb") as f:
            head = f.read(DIRECT_ALIGN)
            header_len = peek_header_len(head)
            if header_len > len(head):
                head += f.read(header_len - len(head))
        return decode_header(head)
    except HeaderVersionError as exc:
        return OldFormat(f"page format of another version: {exc}")
    except (OSError, HeaderError) as exc:
        return f"bad header: {exc}"
