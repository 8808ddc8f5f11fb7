"""`asynchicache bench micro [--json] [--out DIR] [--only SECTION ...]`: micro-benchmarks.

Sections, each a function returning a dict of numbers (merged into one report):

* `radix`: the radix tree on 200 requests of 3,072 random tokens sharing a
  2,048-token prefix (page size 16): insert (hashing included) and match, in
  ms per request, median over rounds with a fresh tree each; plus the same
  through `HiRadixCache` (L1 only), which adds ownership checks and locks.
* `copy`: our transfer engine copying 256 MB of default-model pages (30 layers,
  3 KV heads, head_dim 64, page 16, float32) L1 -> L2 (shared memory) and back,
  against a plain torch `copy_` of as many contiguous bytes, interleaved in the
  same run so the ratio compares like with like.
* `disk` (when `asynchicache/bench/micro/micro_disk.py` is present): its `measure`.
* `redis` (`asynchicache/bench/micro/micro_redis.py`): L4 put/get GB/s against a
  redis-server on loopback started by the benchmark.

Other engineers add a section by adding a module with `measure(args) -> dict`
(and optionally `add_arguments(parser)`) and listing it in `_optional_sections`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import logging
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from asynchicache.bench.reports.output import add_output_arguments, print_report, write_report
from asynchicache.common.keys import Namespace
from asynchicache.common.tiers import Tier
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.l2.transfer import TransferEngine
from asynchicache.hierarchy.pools import DevicePool, HostPool, KVLayout
from asynchicache.hierarchy.radix import RadixTree
from asynchicache.settings.config import CacheConfig

log = logging.getLogger(__name__)

DEFAULT_LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16)
_MB = 1 << 20


@dataclass(frozen=True)
class Section:
    """One named group of measurements."""

    name: str
    measure: Callable[[argparse.Namespace], dict]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None


# -- radix ------------------------------------------------------------------------------------


def _workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(args.vocab) for _ in range(args.prefix_tokens)]
    suffix = args.request_tokens - args.prefix_tokens
    return [
        prefix + [rng.randrange(args.vocab) for _ in range(suffix)] for _ in range(args.requests)
    ]


def _radix_round(requests: list[list[int]], page_size: int, root: bytes) -> tuple[float, float]:
    gc.collect()  # every round starts from the same heap; the collector stays on while timing
    tree = RadixTree(page_size, root)
    next_page = 0
    start = time.perf_counter()
    for tokens in requests:
        n = len(tokens) // page_size
        out = tree.insert(tokens, list(range(next_page, next_page + n)), Tier.DEVICE)
        tree.touch(out.node)
        next_page += n
    inserted = time.perf_counter()
    for tokens in requests:
        path = tree.match(tokens)
        pages: list[int] = []
        for node in path:
            pages += node.device or []
        tree.touch(path[-1])
    matched = time.perf_counter()
    return inserted - start, matched - inserted


def _hicache_round(requests: list[list[int]], page_size: int) -> tuple[float, float]:
    """Insert and match through the scheduler's interface (L1 only, tiny pages)."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, page_size=page_size)
    pages_needed = sum(len(t) // page_size for t in requests)
    cfg = CacheConfig(
        page_size=page_size,
        device_cache_tokens=pages_needed * page_size,
        enable_host_cache=False,
        disk_cache_dir=None,
    )
    cache = HiRadixCache(cfg, layout, Namespace("bench", "float32", page_size), torch.device("cpu"))
    gc.collect()
    try:
        insert_s = 0.0
        for tokens in requests:
            m = cache.match(tokens)
            cache.lock(m.handle)
            fresh = cache.allocate(len(tokens) // page_size - len(m.device_pages)) or []
            start = time.perf_counter()
            result = cache.insert(tokens, m.device_pages + fresh)
            insert_s += time.perf_counter() - start
            cache.unlock(m.handle)
            cache.unlock(result.handle)
        start = time.perf_counter()
        for tokens in requests:
            cache.match(tokens)
        return insert_s, time.perf_counter() - start
    finally:
        cache.close()


def measure_radix(args: argparse.Namespace) -> dict:
    requests = _workload(args)
    root = Namespace("bench", "float32", args.page_size).digest()
    n = len(requests)
    tree_runs = [_radix_round(requests, args.page_size, root) for _ in range(args.rounds)]
    cache_runs = [_hicache_round(requests, args.page_size) for _ in range(args.rounds)]

    def ms(runs: list[tuple[float, float]], i: int) -> float:
        return round(statistics.median(r[i] for r in runs) * 1e3 / n, 4)

    return {
        "radix_insert_ms_per_req": ms(tree_runs, 0),
        "radix_match_ms_per_req": ms(tree_runs, 1),
        "radix_insert_ms_per_req_best": round(min(r[0] for r in tree_runs) * 1e3 / n, 4),
        "radix_match_ms_per_req_best": round(min(r[1] for r in tree_runs) * 1e3 / n, 4),
        "hicache_insert_ms_per_req": ms(cache_runs, 0),
        "hicache_match_ms_per_req": ms(cache_runs, 1),
        "radix_workload": (
            f"{n} requests x {args.request_tokens} tokens, shared prefix {args.prefix_tokens}, "
            f"page {args.page_size}, median of {args.rounds} rounds"
        ),
    }


def add_radix_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("radix")
    group.add_argument("--requests", type=int, default=200)
    group.add_argument("--request-tokens", type=int, default=3072)
    group.add_argument("--prefix-tokens", type=int, default=2048)
    group.add_argument("--page-size", type=int, default=16)
    group.add_argument("--vocab", type=int, default=49152)
    group.add_argument("--rounds", type=int, default=5)
    group.add_argument("--seed", type=int, default=0)


# -- copy -------------------------------------------------------------------------------------


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_copy(args: argparse.Namespace) -> dict:
    layout = DEFAULT_LAYOUT
    pages = max(1, args.copy_mb * _MB // layout.page_bytes)
    nbytes = pages * layout.page_bytes
    l1 = DevicePool(layout, pages, torch.device("cpu"))
    l1.tensor.normal_()
    l2 = HostPool.create(layout, pages, tag="bench")
    engine = TransferEngine(torch.device("cpu"))
    try:
        assert l2.tensor is not None
        l2_tensor = l2.tensor
        l2_tensor.zero_()  # fault the shared pages in before timing
        src = torch.empty(pages * layout.page_numel).normal_()
        dst = torch.zeros_like(src)
        ids = list(range(pages))
        scattered = random.Random(args.seed).sample(ids, len(ids))
        index = torch.tensor(scattered)

        def ours(src_ids: list[int], dst_ids: list[int], down: bool = True) -> None:
            a, b = (l1.tensor, l2_tensor) if down else (l2_tensor, l1.tensor)
            engine.wait(engine.submit(a, src_ids, b, dst_ids))

        runs: dict[str, list[float]] = {}
        for _ in range(args.copy_rounds):
            trials = {
                "torch_copy": lambda: dst.copy_(src),
                "l1_l2_copy": lambda: ours(ids, ids),
                "l1_l2_copy_scattered": lambda: ours(ids, scattered),
                "l2_l1_copy": lambda: ours(ids, ids, down=False),
                # The alternative we did not take: a gather into a temporary, then a scatter.
                "l1_l2_index_copy": lambda: l2_tensor.index_copy_(
                    0, index, l1.tensor.index_select(0, index)
                ),
            }
            for key, fn in trials.items():
                runs.setdefault(key, []).append(_gbps(nbytes, _timed(fn)))
        assert torch.equal(l1.tensor[ids[0]], l2_tensor[ids[0]])
    finally:
        engine.close()
        l2.close()
    best = {f"{k}_GBps": round(max(v), 2) for k, v in runs.items()}
    median = {f"{k}_GBps_median": round(statistics.median(v), 2) for k, v in runs.items()}
    return {
        **best,
        **median,
        "l1_l2_over_torch": round(best["l1_l2_copy_GBps"] / best["torch_copy_GBps"], 3),
        "copy_workload": (
            f"{pages} pages x {layout.page_bytes} B = {nbytes / 1e6:.0f} MB, CPU L1 tensor -> "
            f"/dev/shm L2 pool; best of {args.copy_rounds} interleaved rounds (1 GB = 1e9 B)"
        ),
    }


def add_copy_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("copy")
    group.add_argument("--copy-mb", type=int, default=256)
    group.add_argument("--copy-rounds", type=int, default=7)


# -- registry and entry point -----------------------------------------------------------------


def _optional_sections() -> list[Section]:
    """Sections other files provide; a missing module is skipped."""
    out = []
    for name, module in (
        ("disk", "asynchicache.bench.micro.micro_disk"),
        ("redis", "asynchicache.bench.micro.micro_redis"),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            log.debug("bench section %s not available (%s missing)", name, module)
            continue
        out.append(Section(name, mod.measure, getattr(mod, "add_arguments", None)))
    return out


def sections() -> list[Section]:
    core = [
        Section("radix", measure_radix, add_radix_arguments),
        Section("copy", measure_copy, add_copy_arguments),
    ]
    return core + _optional_sections()


def build_parser(available: list[Section]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynchicache bench micro", description=__doc__)
    add_output_arguments(parser, "micro.json")
    parser.add_argument(
        "--only",
        action="append",
        choices=[s.name for s in available],
        help="run only this section (repeatable); default: all",
    )
    for section in available:
        if section.add_arguments is not None:
            section.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    available = sections()
    args = build_parser(available).parse_args(argv)
    chosen = [s for s in available if not args.only or s.name in args.only]
    report: dict[str, object] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    for section in chosen:
        report.update(section.measure(args))
    write_report(args.out, "micro.json", report)
    print_report(args, report, "\n".join(f"{key:36s} {value}" for key, value in report.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
