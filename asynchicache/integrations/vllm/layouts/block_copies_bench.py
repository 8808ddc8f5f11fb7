"""The connector's copies between vLLM's blocks and L2 pages, on vLLM's CPU layout.

    python -m asynchicache.integrations.vllm.layouts.block_copies_bench \
        [--tokens 1024] [--threads 1]
        [--repeats 20] [--layers 30] [--kv-heads 3] [--head-dim 64] [--block-size 128]
        [--page-size 16] [--kernel vec|amx]

SmolLM2-135M's shape by default (CPU_ATTN's head-major blocks: the vec kernel's, K
transposed, float32; or with `--kernel amx` the amx kernel's tiles, bfloat16). A
prompt of `--tokens` (whole blocks) is saved from vLLM's blocks into L2 slots and
loaded back, two ways each: over consecutive slots (a prompt's fresh slots: the
one-pass copy, layouts.py) and over scattered slots (the gather,
transpose and scatter path). Saves run in vLLM's worker right after the forward
pass, so their time is on every step that computes a prompt. Prints one JSON
object: the median milliseconds of each copy and its GB/s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from asynchicache.integrations.vllm.layouts.block_layouts import BlockCopier, BlockFormat


@dataclass(frozen=True)
class Shape:
    layers: int = 30
    kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 128
    page_size: int = 16


def _median_ms(copy: Callable[[], object], repeats: int) -> float:
    copy()  # first touch of the slots
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        copy()
        times.append(time.perf_counter() - began)
    return round(statistics.median(times) * 1e3, 3)


KERNELS = {
    "vec": (BlockFormat.HEAD_MAJOR_SPLIT, torch.float32),
    "amx": (BlockFormat.HEAD_MAJOR_AMX, torch.bfloat16),
}


def measure(shape: Shape, tokens: int, repeats: int, kernel: str = "vec") -> dict[str, Any]:
    """Median ms of a prompt's save and load over consecutive and scattered slots."""
    blocks = max(1, tokens // shape.block_size)
    pages = blocks * shape.block_size // shape.page_size
    width = 2 * shape.head_dim
    tensors = [
        torch.randn(2 * blocks + 2, shape.kv_heads, shape.block_size, width)
        for _ in range(shape.layers)
    ]
    fmt, dtype = KERNELS[kernel]
    tensors = [t.to(dtype) for t in tensors]
    copier = BlockCopier(tensors, fmt, 1, shape.page_size)
    copier.warm_up(blocks)
    pool = torch.zeros(2 * pages, *copier.page_shape, dtype=dtype)
    block_ids = list(range(1, blocks + 1))
    ways: dict[str, Sequence[int]] = {
        "consecutive": list(range(pages)),
        "scattered": random.Random(0).sample(range(2 * pages), pages),
    }
    out: dict[str, Any] = {
        "tokens": blocks * shape.block_size,
        "shape": vars(shape),
        "kernel": kernel,
    }
    for way, slots in ways.items():
        out[f"save_{way}_ms"] = _median_ms(partial(copier.save, block_ids, pool, slots), repeats)
        out[f"load_{way}_ms"] = _median_ms(partial(copier.load, pool, slots, block_ids), repeats)
    moved = pages * pool[0].numel() * pool.element_size()
    out["bytes"] = moved
    for key in [k for k in out if k.endswith("_ms")]:
        out[key.removesuffix("_ms") + "_GBps"] = round(moved / (out[key] * 1e-3) / 1e9, 2)
    return out


def _parser() -> argparse.ArgumentParser:
    prog = "python -m asynchicache.integrations.vllm.layouts.block_copies_bench"
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1, help="torch threads (vLLM's worker: 1-2)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--kernel", choices=list(KERNELS), default="vec", help="CPU_ATTN's kernel")
    for name, default in vars(Shape()).items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = Shape(args.layers, args.kv_heads, args.head_dim, args.block_size, args.page_size)
    result = measure(shape, args.tokens, args.repeats, args.kernel)
    result["threads"] = args.threads
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
