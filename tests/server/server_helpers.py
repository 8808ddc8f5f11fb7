"""A live HTTP server for tests: the real app under uvicorn, in a thread, on a free port."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx

from asynchicache.launch.frontend import Frontend
from asynchicache.server.context import AppContext, ModelInfo
from asynchicache.server.engine_client import EngineClient
from asynchicache.server.http import StopSignal, bind_socket, serve_http
from asynchicache.settings.config import ServerConfig
from asynchicache.storage.client.probe import ServiceProbe

API_KEY = "test-key"
ADMIN_KEY = "operator-key"
FAKE_CONTEXT = 256


class ThreadServer:
    """The real app under uvicorn on a free port, in a thread, talking to an engine over IPC."""

    def __init__(
        self,
        run_dir: Path,
        frontend: Frontend,
        api_key: str | None,
        admin_api_key: str | None = None,
        service_addr: str | None = None,
        config: ServerConfig | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.service_addr = service_addr  # a cache service /ready pings, as `serve`'s does
        self.frontend = frontend
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        # `config.host` is what the server believes it listens on (loopback or beyond).
        self.config = config or ServerConfig(log_level="warning")
        self.sock = bind_socket(self.config.host, 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: StopSignal | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = StopSignal(asyncio.Event())
        client = EngineClient.for_run_dir(self.run_dir)
        await client.start()
        model = ModelInfo("fake-model", FAKE_CONTEXT, self.frontend.config.vocab_size)
        probe = None if self.service_addr is None else ServiceProbe(self.service_addr)
        ctx = AppContext(
            client,
            self.frontend.bounded_tokenizer(FAKE_CONTEXT),  # as `serve` does
            model,
            api_key=self.api_key,
            admin_api_key=self.admin_api_key,
            service_probe=probe,
            max_request_tokens=self.config.max_request_tokens,
        )
        try:
            await serve_http(ctx, self.config, self.sock, self._stop)
        finally:
            await client.close()
            if probe is not None:
                probe.close()

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("the test server did not become healthy")

    def __enter__(self) -> ThreadServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set, "test done")
        self._thread.join(15)
        self.sock.close()
