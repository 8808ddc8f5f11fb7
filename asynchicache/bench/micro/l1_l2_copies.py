"""L1 <-> L2 page copies (hierarchy/l2/transfer.py) against torch's own copy of the same bytes.

    python -m asynchicache.bench.micro.l1_l2_copies [--device cuda] [--pages 512] [--repeats 5]

L1 is a device pool `[pages, layers, 2, page_size, kv_heads, head_dim]` (SmolLM2's
page by default), L2 a HostPool (shared memory; pinned with cudaHostRegister on
CUDA). For each direction, GB/s of `TransferEngine` moving every page (one run of
consecutive pages, and the same pages scattered over the slots: one copy per page),
and of one torch `copy_` of the same bytes between the device tensor and a torch
pinned host tensor: on a GPU that is the PCIe/NVLink bound (`*_vs_torch`: ours over
torch's, 1.0 = as fast). Best of --repeats. On the CPU it runs with nothing pinned
(what scripts/gpu-check.sh's dry run checks).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asynchicache.hierarchy.l2.transfer import TransferEngine
from asynchicache.hierarchy.pools import HostPool, KVLayout


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_s(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    run()  # warm-up: first touch, stream and allocator set-up
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        began = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - began)
    return best


def _ours(
    engine: TransferEngine, src: torch.Tensor, dst: torch.Tensor, slots: Sequence[int]
) -> Callable[[], None]:
    """Every page of `src` to `slots` of `dst` (or back) through the transfer engine,
    waiting for its ticket as the cache does (poll, never a device-wide sync)."""
    pages = list(range(len(slots)))

    def run() -> None:
        ticket = engine.submit(src, pages, dst, slots)
        done = engine.wait(ticket, timeout=60)
        if done.error is not None:
            raise RuntimeError(f"page copy failed: {done.error}")

    return run


def measure(layout: KVLayout, pages: int, repeats: int, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    l1 = torch.randn(pages, *layout.page_shape, device=device).to(layout.dtype)
    l2 = HostPool.create(layout, pages, pin_memory=cuda, tag="bench")
    assert l2.tensor is not None
    host = torch.empty(l1.shape, dtype=layout.dtype, pin_memory=cuda)
    engine = TransferEngine(device)
    scattered = random.Random(0).sample(range(pages), pages)
    nbytes = l1.numel() * l1.element_size()
    out: dict[str, Any] = {
        "copy_device": str(device),
        "copy_pages": pages,
        "copy_bytes": nbytes,
        "l2_pinned": l2.pinned,
    }
    try:
        runs = {
            "l1_to_l2": _ours(engine, l1, l2.tensor, list(range(pages))),
            "l1_to_l2_scattered": _ours(engine, l1, l2.tensor, scattered),
            "torch_d2h": lambda: host.copy_(l1, non_blocking=cuda),
            "l2_to_l1": _ours(engine, l2.tensor, l1, list(range(pages))),
            "l2_to_l1_scattered": _ours(engine, l2.tensor, l1, scattered),
            "torch_h2d": lambda: l1.copy_(host, non_blocking=cuda),
        }
        for name, run in runs.items():
            out[f"{name}_GBps"] = round(nbytes / _best_s(run, device, repeats) / 1e9, 2)
        engine.submit(l1, [0], l2.tensor, [0])
        copied = engine.wait(engine.submit(l1, [0], l2.tensor, [1]), timeout=60)
        out["bytes_equal"] = copied.error is None and bool(
            torch.equal(l1[0].cpu(), l2.tensor[1]) and torch.equal(l1[0].cpu(), l2.tensor[0])
        )
    finally:
        engine.close()
        l2.close()
    out["l1_to_l2_vs_torch"] = round(out["l1_to_l2_GBps"] / out["torch_d2h_GBps"], 3)
    out["l2_to_l1_vs_torch"] = round(out["l2_to_l1_GBps"] / out["torch_h2d_GBps"], 3)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m asynchicache.bench.micro.l1_l2_copies")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pages", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.pages <= 0 or args.repeats <= 0:
        raise SystemExit("--pages and --repeats must be positive")
    dtype = getattr(torch, args.dtype)
    layout = KVLayout(args.layers, args.kv_heads, args.head_dim, args.page_size, dtype)
    print(
        json.dumps(measure(layout, args.pages, args.repeats, torch.device(args.device)), indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
