"""The HTTP port answers keep-alive requests without Nagle's delay.

asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is TCP; a socket
bound with proto 0 left it on, and every response that went out in two writes on a
kept-alive connection waited ~40 ms for the client's delayed ACK (every /health,
every non-streamed completion's TTFT as a client saw it).
"""

from __future__ import annotations

import asyncio
import socket

from asynchicache.server.http import bind_socket


class _Seen(asyncio.Protocol):
    def __init__(self, seen: asyncio.Future[int]) -> None:
        self.seen = seen

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        self.seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        transport.close()


async def _accepted_nodelay() -> int:
    sock = bind_socket("127.0.0.1", 0)
    sock.listen()
    loop = asyncio.get_running_loop()
    seen: asyncio.Future[int] = loop.create_future()
    server = await loop.create_server(lambda: _Seen(seen), sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname())
        value = await asyncio.wait_for(seen, 5)
        writer.close()
        return value
    finally:
        server.close()


def test_accepted_connections_have_nagle_off() -> None:
    assert asyncio.run(_accepted_nodelay()) != 0
