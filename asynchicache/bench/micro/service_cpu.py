"""`python -m asynchicache.bench.micro.service_cpu`: the CPU the cache service spends per
stored page.

    python -m asynchicache.bench.micro.service_cpu [--pages 512] [--batch 32] [--dir DIR]

A real cache service process (`asynchicache service`, disk
tier only, page files buffered as the vLLM connector's service writes them by
default) stores `--pages` pages of the default model's shape (30 layers x 2 x
16 tokens x 3 KV heads x 64 x float32 = 737,280 bytes) from a shared-memory
L2 pool, `--batch` pages per store (a request's prompt), as the connector
sends them. The service's CPU time (user + system, every thread, from
/proc/PID/stat) over the stores, divided by the pages, is what a store takes
from vLLM's compute threads on a host whose cores they all use (issue 40:
saves that do not slow the step). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asynchicache.common.keys import Namespace, chain_hashes
from asynchicache.hierarchy.pools import HostPool, KVLayout
from asynchicache.storage.base import PageLayout, PageRef
from asynchicache.storage.client.client_config import ClientConfig
from asynchicache.storage.client.storage_client import StorageClient

PAGE = 16
LAYOUT = KVLayout(30, 3, 64, PAGE, torch.float32)  # SmolLM2-135M's page


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid`, every thread, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(pages: int, batch: int, folder: Path) -> dict[str, Any]:
    address = f"ipc://{folder}/service.sock"
    argv = [sys.executable, "-m", "asynchicache", "service",
            "--disk-cache-dir", str(folder / "kv"), "--address", address,
            "--no-direct-io", "--log-level", "WARNING"]  # fmt: skip
    service = subprocess.Popen(argv)
    pool = HostPool.create(LAYOUT, pages, tag="bench")
    client: StorageClient | None = None
    try:
        assert pool.tensor is not None
        pool.tensor.copy_(torch.randn(pool.tensor.shape))
        namespace = Namespace("bench-service-cpu", "float32", PAGE)
        ns, root = namespace.encode(), namespace.digest()
        layout = PageLayout("float32", LAYOUT.page_shape)
        client = StorageClient(ClientConfig(address, ns, pool.name, layout, ticket_timeout_s=600))
        if not client.wait_ready(60):
            raise RuntimeError("the cache service did not answer")
        tokens = list(range(pages * PAGE))
        hashes = chain_hashes(root, tokens, PAGE)
        parents = [root, *hashes[:-1]]
        refs = [
            PageRef(h, tuple(tokens[i * PAGE : (i + 1) * PAGE]), i, parents[i])
            for i, h in enumerate(hashes)
        ]
        before, t0 = cpu_seconds(service.pid), time.perf_counter()
        tickets = [client.submit_store(refs[i : i + batch]) for i in range(0, pages, batch)]
        done = client.wait(tickets, timeout_s=600)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(service.pid) - before
        stored = sum(c.pages_ok for c in done)
    finally:
        if client is not None:
            client.close()
        service.terminate()
        service.wait(60)
        pool.close()
    return {
        "pages": pages,
        "pages_stored": stored,
        "batch": batch,
        "page_bytes": LAYOUT.page_bytes,
        "service_cpu_s": round(cpu, 4),
        "service_cpu_ms_per_page": round(1000 * cpu / max(1, stored), 3),
        "wall_s": round(wall, 4),
        "MBps": round(stored * LAYOUT.page_bytes / wall / 1e6, 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asynchicache.bench.micro.service_cpu", description=__doc__)
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dir", type=Path, default=None, help="where the page files go (tmp)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="asynchicache-service-cpu-") as d:
        print(json.dumps(measure(a.pages, a.batch, Path(d)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
