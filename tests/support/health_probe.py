"""`HealthProbe`: GET /health every 20 ms in a thread while a test loads the server; the
latencies, in ms (issue 22's and issue 39's "/health answers within 100 ms while ...")."""

from __future__ import annotations

import threading
import time

import httpx

HEALTH_MS = 100


class HealthProbe:
    """GET /health every 20 ms in a thread; the latencies, in ms."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.is_set():
                t = time.perf_counter()
                assert http.get(self.url + "/health").status_code == 200
                self.latencies.append((time.perf_counter() - t) * 1000)
                time.sleep(0.02)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)
