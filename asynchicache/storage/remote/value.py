"""One page as a Redis value: the SET framed around the slot, the GET reply checked into it.

    value = header (storage.header, as in disk files) + the page's bytes

A SET goes out as four buffers (RESP framing, header, the slot's memory,
framing) so the payload is never joined into a new object. A GET reply is
read header first: only a header that parses and matches (namespace, page
hash, layout, lengths) lets the payload be received into the L2 slot, and the
payload's checksum is verified after. A rejected value is consumed from the
stream in full, so the connection stays usable for the replies after it.

With --cache-encrypt (storage.page_cipher) the SET sends the page's
ciphertext from a per-thread scratch buffer (one per page of a pipelined
batch), and a GET receives it piece by piece into scratch, decrypting each
piece into the slot as it arrives (`RECEIVE_CHUNK`).
"""

from __future__ import annotations

from dataclasses import dataclass

from asynchicache.storage.base import PageLayout
from asynchicache.storage.header import (
    HEADER_ALIGN,
    HeaderError,
    PageHeader,
    associated_data,
    body_buffer,
    decode_header,
    open_page,
    peek_header_len,
    seal_page,
)
from asynchicache.storage.page_cipher import RECEIVE_CHUNK, UNKNOWN_KEY, PageCipher, finish
from asynchicache.storage.page_keys import MacMismatch, NamespaceKeys
from asynchicache.storage.remote.resp import RespConnection


class ValueRejected(Exception):
    """A stored value that is not a valid page of ours (the reason is the message)."""


class MacRejected(ValueRejected):
    """A value whose keyed MAC is missing or does not verify (storage.page_keys)."""


@dataclass(frozen=True)
class ValueFormat:
    """How the pages of one namespace and layout are stored."""

    namespace: bytes
    layout: PageLayout
    ttl_s: int | None = None
    keys: NamespaceKeys | None = None  # --cache-key-file: values carry a keyed MAC

    def set_command(
        self,
        key: bytes,
        page_hash: bytes,
        tokens: tuple[int, ...],
        payload: memoryview,
        parent: bytes = b"",
        buffer: int = 0,
    ) -> list[bytes | memoryview]:
        """SET key <header + payload> [EX ttl] as buffers around the slot's memory (or
        around its ciphertext in this thread's scratch buffer `buffer`, when encrypted:
        the buffers must be sent before that scratch buffer is used again)."""
        header, body = seal_page(
            PageHeader(
                self.namespace,
                page_hash,
                tokens,
                self.layout,
                self.layout.page_bytes,
                b"",  # the checksum: filled by seal_page
                parent,
            ),
            self.keys,
            payload,
            buffer,
        )
        argc = 3 if self.ttl_s is None else 5
        value_len = len(header) + len(payload)
        head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(key), key, value_len)
        tail = b"\r\n"
        if self.ttl_s is not None:
            t = str(self.ttl_s).encode()
            tail += b"$2\r\nEX\r\n$%d\r\n%s\r\n" % (len(t), t)
        return [head, header, body, tail]

    def read_page(
        self, conn: RespConnection, page_hash: bytes, dst: memoryview
    ) -> PageHeader | None:
        """Read one GET reply into `dst`: the page's header, or None for a missing key.

        Raises ValueRejected (value consumed), RespError (an error reply) or OSError.
        """
        n = conn.read_bulk_len()
        if n is None:
            return None
        header = self._read_header(conn, n)
        problem = self._problem(header, page_hash, n)
        if problem is not None:
            conn.skip(n - header.header_len)
            conn.end_bulk()
            raise ValueRejected(problem)
        cipher = self.keys.cipher if self.keys is not None else None
        if header.encrypted and cipher is not None:  # (_problem refused it otherwise)
            self._receive_encrypted(conn, header, cipher, dst)
            return header
        body = body_buffer(self.keys, dst)  # the L2 slot itself, unless encrypted
        conn.read_into(body)  # [page_bytes]
        conn.end_bulk()
        problem = open_page(header, self.keys, body, dst)
        if isinstance(problem, MacMismatch):
            raise MacRejected(problem)
        if problem is not None:
            raise ValueRejected(problem)
        return header

    def _receive_encrypted(
        self, conn: RespConnection, header: PageHeader, cipher: PageCipher, dst: memoryview
    ) -> None:
        """Receive an encrypted payload piece by piece into scratch, decrypting each piece
        into `dst` while it is in cache; MacRejected (value consumed) if the tag fails."""
        dec = cipher.decryptor(header.key_id, header.mac, associated_data(header))
        if dec is None:
            conn.skip(header.payload_len)
            conn.end_bulk()
            raise MacRejected(UNKNOWN_KEY)
        chunk = cipher.scratch.get(0, min(RECEIVE_CHUNK, len(dst)))
        for off in range(0, len(dst), len(chunk)):
            part = chunk[: min(len(chunk), len(dst) - off)]
            conn.read_into(part)
            dec.update_into(part, dst[off : off + len(part)])
        conn.end_bulk()
        why = finish(dec)
        if why is not None:
            raise MacRejected(why)

    def _read_header(self, conn: RespConnection, n: int) -> PageHeader:
        """The header of an `n`-byte value (longer headers read on); ValueRejected if bad."""
        head = bytearray(min(n, HEADER_ALIGN))
        conn.read_into(memoryview(head))
        taken = len(head)
        try:
            header_len = peek_header_len(head)
            if header_len > n:
                raise HeaderError(f"header of {header_len} bytes in a {n}-byte value")
            if header_len > taken:
                head.extend(bytes(header_len - taken))
                conn.read_into(memoryview(head)[taken:])
                taken = header_len
            return decode_header(head)
        except HeaderError as exc:
            conn.skip(n - taken)
            conn.end_bulk()
            raise ValueRejected(f"bad header ({exc})") from exc

    def _problem(self, header: PageHeader, page_hash: bytes, n: int) -> str | None:
        problem = header.mismatch(self.namespace, self.layout, page_hash, "the key")
        if problem is not None:
            return problem
        if n != header.header_len + header.payload_len:
            return f"value of {n} bytes != header + payload"
        if header.encrypted and (self.keys is None or self.keys.cipher is None):
            return "encrypted value (this reader has no --cache-encrypt)"
        return None
