"""ValueFormat.read_page on hostile replies (hypothesis), over a real loopback socket.

Whatever a server sends as a GET reply, the reader either accepts a page whose
bytes are exactly the ones stored, or rejects it; it never raises anything
else, and a rejected value is consumed so the next reply still parses.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pools import NAMESPACE, SMALL

from asynchicache.storage.header import decode_header
from asynchicache.storage.remote.resp import (
    ConnectionParams,
    NodeAddress,
    RespConnection,
    RespError,
    RespProtocolError,
)
from asynchicache.storage.remote.value import ValueFormat, ValueRejected

FORMAT = ValueFormat(NAMESPACE, SMALL)
HASH = bytes(range(16))
PAYLOAD = np.random.default_rng(5).integers(0, 256, SMALL.page_bytes, dtype=np.uint8)
TOKENS = (1, 2, 3, 4)


def _stored_value() -> bytes:
    parts = FORMAT.set_command(b"k", HASH, TOKENS, memoryview(PAYLOAD))
    return bytes(parts[1]) + bytes(parts[2])  # header + payload, as Redis keeps it


VALUE = _stored_value()


def test_value_header_names_the_parent_page() -> None:
    parent = bytes(range(50, 66))
    parts = FORMAT.set_command(b"k", HASH, TOKENS, memoryview(PAYLOAD), parent)
    header = decode_header(bytes(parts[1]))
    assert (header.page_hash, header.parent, header.tokens) == (HASH, parent, TOKENS)


@pytest.fixture(scope="module")
def listener() -> Iterator[socket.socket]:
    sock = socket.create_server(("127.0.0.1", 0))
    yield sock
    sock.close()


def _serve_once(listener: socket.socket, reply: bytes) -> RespConnection:
    """A connection whose peer sends `reply` and then closes."""

    def serve() -> None:
        peer, _ = listener.accept()
        with peer:
            peer.sendall(reply)

    t = threading.Thread(target=serve)
    t.start()
    host, port = listener.getsockname()
    conn = RespConnection(NodeAddress(host, port), ConnectionParams(socket_timeout_s=5.0))
    t.join()
    return conn


def _read(listener: socket.socket, reply: bytes, in_sync: bool = True) -> tuple[str, np.ndarray]:
    conn = _serve_once(listener, reply + b"+OK\r\n")
    dst = np.zeros(SMALL.page_bytes, dtype=np.uint8)
    try:
        tokens = FORMAT.read_page(conn, HASH, memoryview(dst))
        outcome = "missing" if tokens is None else "ok"
    except ValueRejected:
        outcome = "rejected"
    except RespError:
        outcome = "error-reply"
    except RespProtocolError:
        conn.close()
        return "protocol", dst
    if in_sync:  # a well-framed reply was consumed exactly: the next one parses
        assert conn.read_status() == b"OK"
    conn.close()
    return outcome, dst


def test_a_good_value_round_trips(listener: socket.socket) -> None:
    outcome, dst = _read(listener, b"$%d\r\n%s\r\n" % (len(VALUE), VALUE))
    assert outcome == "ok" and np.array_equal(dst, PAYLOAD)
    assert _read(listener, b"$-1\r\n")[0] == "missing"
    assert _read(listener, b"-WRONGTYPE not a string\r\n")[0] == "error-reply"


@settings(max_examples=150, deadline=None)
@given(position=st.integers(0, len(VALUE) - 1), flip=st.integers(1, 255))
def test_any_flipped_byte_is_rejected_or_harmless(
    listener: socket.socket, position: int, flip: int
) -> None:
    damaged = bytearray(VALUE)
    damaged[position] ^= flip
    outcome, dst = _read(listener, b"$%d\r\n%s\r\n" % (len(damaged), damaged))
    # Accepted only if the flip hit the header's zero padding: the page itself is intact.
    assert outcome == "rejected" or (outcome == "ok" and np.array_equal(dst, PAYLOAD))


@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=6000), cut=st.integers(0, len(VALUE)))
def test_garbage_and_truncated_values_are_rejected(
    listener: socket.socket, body: bytes, cut: int
) -> None:
    for value in (body, VALUE[:cut], VALUE + body):
        if value == VALUE:
            continue
        outcome, _ = _read(listener, b"$%d\r\n%s\r\n" % (len(value), value))
        assert outcome == "rejected"


@settings(max_examples=100, deadline=None)
@given(reply=st.binary(max_size=200))
def test_malformed_framing_is_a_protocol_error(listener: socket.socket, reply: bytes) -> None:
    """Anything at all: only the four outcomes, never another exception."""
    outcome, _ = _read(listener, reply, in_sync=False)
    assert outcome in ("ok", "missing", "rejected", "error-reply", "protocol")
