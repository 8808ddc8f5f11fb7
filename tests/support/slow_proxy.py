"""A TCP proxy that holds every reply of the server for `delay_s` before passing it on:
a real Redis made slow (each reply late, but earlier than the client's timeouts)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from ports import free_port


class SlowProxy:
    """127.0.0.1:`port` -> 127.0.0.1:`target`; server-to-client data waits `delay_s`."""

    def __init__(self, target: int, delay_s: float) -> None:
        self.target = target
        self.delay_s = delay_s
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [client, server]
            for src, dst, delay in ((client, server, 0.0), (server, client, self.delay_s)):
                t = threading.Thread(target=self._pump, args=(src, dst, delay), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                data = src.recv(1 << 20)
                if not data:
                    break
                if delay_s:
                    time.sleep(delay_s)
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
        for t in self._threads:
            t.join(timeout=2.0)
