"""Remote tier micro-benchmark: `RedisBackend` against a redis-server on loopback.

    python -m asynchicache.bench.micro.micro_redis [--redis-total-mb 256] [--redis-repeats 3]

Pages are shaped like the default model's (30 layers x 2 x 16 tokens x 3 KV
heads x 64 x float32 = 737,280 bytes) and move between a real shared-memory
pool and a redis-server the benchmark starts (no persistence, its own temp
folder; or `--redis-url` for one already running):

* `redis_put_GBps`: `put` of every page (header + checksum per page, sent
  straight from the slots), `--redis-call-pages` pages per call;
* `redis_get_GBps`: `get` of every page into other slots, header and checksum
  verified, payload received straight into the slots;
* `redis_py_get_GBps`: the naive client in the same run: a redis-py (hiredis)
  pipeline of GETs, each reply copied into its slot and checksummed;
* `redis_mac_put_GBps`, `redis_mac_get_GBps`: the same `put` and `get` with a
  `--cache-key-file` key (every value signed, every read verified: AES-GMAC
  over header and payload, storage.page_keys; a read whose MAC verifies skips
  the checksum it covers), in the same round as the plain arm (each round
  rotates the arms' order); `mac_put_ratio`/`mac_get_ratio` are plain / keyed throughput (the
  issue's bound: at most 1.1);
* `redis_enc_put_GBps`, `redis_enc_get_GBps`: the same with `--cache-encrypt`
  (AES-256-GCM into per-thread scratch, the tag in place of the MAC,
  storage.page_cipher), in the same round; `enc_put_ratio`/`enc_get_ratio`
  are plain / encrypted throughput (the same bound);
* `cpu_*_s_per_GB`: this process's CPU seconds (all threads) per GB of each arm,
  and `*_cpu_ratio`: keyed / plain CPU (less sensitive to a busy host than the
  throughput ratios; the redis-server's CPU is not counted);
* `sweep`: get GB/s by I/O threads x pages per pipelined batch.

GB/s count page payload bytes, 1e9 per GB; medians over the repeats.
`measure(args)` returns the numbers (the `redis` section of `bench micro`);
`main()` prints them as JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import redis

from asynchicache.bench.micro import micro_pages
from asynchicache.bench.micro.micro_pages import DEFAULT_LAYOUT
from asynchicache.bench.processes.server_process import free_port
from asynchicache.storage.header import HEADER_ALIGN, payload_checksum
from asynchicache.storage.page_keys import PageKeys
from asynchicache.storage.remote.remote_backend import RedisBackend
from asynchicache.storage.remote.remote_config import RedisConfig

_NAMESPACE = b"bench-micro-redis\x1ffloat32\x1f16\x1f1\x1f"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("redis section")
    g.add_argument("--redis-total-mb", type=int, default=256, help="bytes moved per measurement")
    g.add_argument("--redis-repeats", type=int, default=3)
    g.add_argument("--redis-url", default=None, help="use this server (default: start one)")
    g.add_argument("--redis-threads", type=int, default=RedisConfig.io_threads)
    g.add_argument("--redis-batch-pages", type=int, default=RedisConfig.batch_pages)
    g.add_argument("--redis-call-pages", type=int, default=128, help="pages per get/put call")
    g.add_argument("--redis-no-sweep", action="store_true", help="skip the threads x batch sweep")


@contextmanager
def local_redis() -> Iterator[str]:
    """A throw-away redis-server on loopback (no persistence); yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found: run scripts/ensure-services.sh (as root)")
    folder = Path(tempfile.mkdtemp(prefix="asynchicache-bench-redis-"))
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(folder), "--loglevel", "warning"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the benchmark's redis-server did not start") from None
                time.sleep(0.02)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def _naive_get_all(client: redis.Redis, keys: list[bytes], pool: np.ndarray, step: int) -> float:
    """The usual client code: pipeline GETs, copy each reply into its slot, checksum it."""
    pages = len(keys)
    pool[pages:] = 0
    t0 = time.perf_counter()
    for k in range(0, pages, step):
        pipe = client.pipeline(transaction=False)
        for key in keys[k : k + step]:
            pipe.get(key)
        for i, value in enumerate(pipe.execute()):
            slot = pool[pages + k + i]
            slot[:] = np.frombuffer(value, dtype=np.uint8, offset=HEADER_ALIGN)
            payload_checksum(slot)
    seconds = time.perf_counter() - t0
    if not np.array_equal(pool[pages:], pool[:pages]):
        raise RuntimeError("the naive client read different pages")
    return seconds


def _backend(url: str, threads: int, batch: int, keys: PageKeys | None = None) -> RedisBackend:
    cfg = RedisConfig(
        url, _NAMESPACE, DEFAULT_LAYOUT, io_threads=threads, batch_pages=batch, keys=keys
    )
    backend = RedisBackend(cfg)
    if not backend.wait_available(10.0):
        backend.close()
        raise RuntimeError(f"redis at {url} is not reachable")
    return backend


def _one_round(
    url: str, pool: np.ndarray, pages: int, args: argparse.Namespace, index: int
) -> dict:
    """One round of every arm; round `index` rotates their order, so that no arm is
    always the first or the last on the server (a fixed order measured the last arm a
    few percent slower whatever it did)."""
    arms: list[Callable[[], dict[str, float]]] = [
        lambda: _plain_arm(url, pool, pages, args),
        lambda: _keyed_arm(url, pool, pages, args, "mac", False),
        lambda: _keyed_arm(url, pool, pages, args, "enc", True),
    ]
    shift = index % len(arms)
    out: dict[str, float] = {}
    for arm in arms[shift:] + arms[:shift]:
        out.update(arm())
    return out


def _plain_arm(url: str, pool: np.ndarray, pages: int, args: argparse.Namespace) -> dict:
    total = pages * DEFAULT_LAYOUT.page_bytes
    backend = _backend(url, args.redis_threads, args.redis_batch_pages)
    naive = redis.Redis.from_url(url)
    try:
        backend.clear()
        hashes = [os.urandom(16) for _ in range(pages)]
        put_s, put_cpu = _timed(micro_pages.put_all, backend, pool, hashes, args.redis_call_pages)
        get_s, get_cpu = _timed(micro_pages.get_all, backend, pool, hashes, args.redis_call_pages)
        keys = [backend.key(h) for h in hashes]
        naive_s = _naive_get_all(naive, keys, pool, args.redis_call_pages)
        backend.clear()
    finally:
        naive.close()
        backend.close()
    gb = total / 1e9
    return {
        "redis_put_GBps": gb / put_s,
        "redis_get_GBps": gb / get_s,
        "redis_py_get_GBps": gb / naive_s,
        "cpu_put_s_per_GB": put_cpu / gb,
        "cpu_get_s_per_GB": get_cpu / gb,
    }


def _timed(fn: Callable[..., float], *args: object) -> tuple[float, float]:
    """`fn`'s own wall seconds, and this process's CPU seconds (all its threads) meanwhile."""
    cpu = time.process_time()
    wall = fn(*args)
    return wall, time.process_time() - cpu


def _keyed_arm(
    url: str, pool: np.ndarray, pages: int, args: argparse.Namespace, name: str, encrypt: bool
) -> dict[str, float]:
    """`put` and `get` of every page with a key file's MAC on each value (or, `encrypt`,
    each value AES-GCM encrypted): GB/s and CPU seconds per GB, keys named by `name`."""
    keys = PageKeys((os.urandom(32).hex().encode(),), encrypt)
    backend = _backend(url, args.redis_threads, args.redis_batch_pages, keys)
    try:
        backend.clear()
        hashes = [os.urandom(16) for _ in range(pages)]
        put_s, put_cpu = _timed(micro_pages.put_all, backend, pool, hashes, args.redis_call_pages)
        get_s, get_cpu = _timed(micro_pages.get_all, backend, pool, hashes, args.redis_call_pages)
        if backend.stats().extra.get("mac_failures", 0.0):
            raise RuntimeError("signed (or encrypted) pages failed their MAC (or tag)")
        backend.clear()
    finally:
        backend.close()
    gb = pages * DEFAULT_LAYOUT.page_bytes / 1e9
    return {
        f"redis_{name}_put_GBps": gb / put_s,
        f"redis_{name}_get_GBps": gb / get_s,
        f"cpu_{name}_put_s_per_GB": put_cpu / gb,
        f"cpu_{name}_get_s_per_GB": get_cpu / gb,
    }


def _sweep(url: str, pool: np.ndarray, pages: int, args: argparse.Namespace) -> dict[str, float]:
    """get GB/s for a few threads x batch settings (one run each, after one put)."""
    total = pages * DEFAULT_LAYOUT.page_bytes
    hashes = [os.urandom(16) for _ in range(pages)]
    writer = _backend(url, args.redis_threads, args.redis_batch_pages)
    out: dict[str, float] = {}
    try:
        writer.clear()
        micro_pages.put_all(writer, pool, hashes, args.redis_call_pages)
        for threads, batch in ((1, 8), (2, 8), (4, 8), (8, 8), (4, 2), (4, 32)):
            reader = _backend(url, threads, batch)
            try:
                seconds = micro_pages.get_all(reader, pool, hashes, args.redis_call_pages)
            finally:
                reader.close()
            out[f"threads={threads},batch={batch}"] = round(total / seconds / 1e9, 3)
        writer.clear()
    finally:
        writer.close()
    return out


def measure(args: argparse.Namespace) -> dict:
    """Run the redis section; see the module docstring for what each number means."""
    pages = micro_pages.pages_for(args.redis_total_mb)
    with micro_pages.bench_pool(pages) as pool, _server(args.redis_url) as url:
        runs = [_one_round(url, pool, pages, args, i) for i in range(args.redis_repeats)]
        sweep = {} if args.redis_no_sweep else _sweep(url, pool, pages, args)
    keys = list(runs[0])
    medians = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
    return {
        **medians,
        "get_vs_redis_py": round(medians["redis_get_GBps"] / medians["redis_py_get_GBps"], 2),
        "mac_put_ratio": round(medians["redis_put_GBps"] / medians["redis_mac_put_GBps"], 3),
        "mac_get_ratio": round(medians["redis_get_GBps"] / medians["redis_mac_get_GBps"], 3),
        "enc_put_ratio": round(medians["redis_put_GBps"] / medians["redis_enc_put_GBps"], 3),
        "enc_get_ratio": round(medians["redis_get_GBps"] / medians["redis_enc_get_GBps"], 3),
        # CPU seconds of this process per GB moved, keyed / plain: what a busy host shows
        # less than throughput does (the redis-server's CPU is not counted).
        "mac_put_cpu_ratio": _ratio(medians, "cpu_mac_put_s_per_GB", "cpu_put_s_per_GB"),
        "mac_get_cpu_ratio": _ratio(medians, "cpu_mac_get_s_per_GB", "cpu_get_s_per_GB"),
        "enc_put_cpu_ratio": _ratio(medians, "cpu_enc_put_s_per_GB", "cpu_put_s_per_GB"),
        "enc_get_cpu_ratio": _ratio(medians, "cpu_enc_get_s_per_GB", "cpu_get_s_per_GB"),
        "runs": [{k: round(r[k], 3) for k in keys} for r in runs],
        "sweep_get_GBps": sweep,
        "backend": f"{args.redis_threads} threads, {args.redis_batch_pages} pages per pipeline, "
        f"{args.redis_call_pages} pages per call",
        "server": args.redis_url or "redis-server on loopback started by the benchmark",
        "pages": pages,
        "page_bytes": DEFAULT_LAYOUT.page_bytes,
        "total_MB": round(pages * DEFAULT_LAYOUT.page_bytes / 1e6, 1),
    }


def _ratio(medians: dict[str, float], num: str, den: str) -> float:
    return round(medians[num] / medians[den], 3) if medians[den] else 0.0


@contextmanager
def _server(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    with local_redis() as started:
        yield started


def main(argv: list[str] | None = None) -> int:
    description = "remote tier throughput"
    return micro_pages.section_main("micro_redis", description, add_arguments, measure, argv)


if __name__ == "__main__":
    raise SystemExit(main())
