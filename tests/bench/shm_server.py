"""A server made like vLLM's, for test_server_stop.py: `GET /health` answers 200; it
holds multiprocessing shared memory it never unlinks (its resource tracker does, once
the processes that used it are gone) and a child in its process group that ignores
SIGTERM and exits a second after it. `--mode exits`: SIGTERM ends it at once (no
clean-up, no joining its child); `--mode hangs`: it ignores SIGTERM too. `--out`: a
file that gets the segment's name once it is ready.
"""

from __future__ import annotations

import argparse
import http.server
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path


def child(parent: int) -> None:
    """Ignores SIGTERM, and exits a second after its parent did (as vLLM's engine core
    watches its API server, then shuts down). Spawned by multiprocessing, it shares
    the resource tracker: the tracker cleans up only once it is gone too."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while os.getppid() == parent:
        time.sleep(0.1)
    time.sleep(1.0)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=["exits", "hangs"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    # Never closed nor unlinked here: as a killed vLLM process leaves its psm_* segments.
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    multiprocessing.get_context("spawn").Process(target=child, args=(os.getpid(),)).start()
    if args.mode == "hangs":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    args.out.write_text(segment.name)
    httpd = http.server.HTTPServer(("127.0.0.1", args.port), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
