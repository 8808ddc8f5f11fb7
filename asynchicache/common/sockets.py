"""ZeroMQ helpers shared by every process that reads a socket in a loop that must not block."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import zmq

T = TypeVar("T")


def queued(recv: Callable[[int], T]) -> Iterator[T]:
    """The messages `recv` (a socket's `recv` or `recv_multipart`) has waiting, one by one;
    ends, without waiting, when there are none. A message is taken only when asked for, so
    a caller that stops early leaves the rest queued."""
    while True:
        try:
            yield recv(zmq.NOBLOCK)
        except zmq.Again:
            return
