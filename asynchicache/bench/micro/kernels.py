"""Native kernels per instruction set against torch's own ops, per op and per forward.

    python -m asynchicache.bench.micro.kernels [--model PATH] [--prompt-tokens 1557] [--threads N]

For every build of the native kernels this CPU runs (`native.ISAS`: avx512, avx2) and for
torch's ops, the best of --repeats seconds of: one layer's attention over a whole prompt,
each row op at the prompt's shapes (the model's: hidden, intermediate, heads), and the
whole prefill forward. Taking turns, so every arm sees the same load. Prints one JSON
object: `seconds[op][arm]`, `fastest[op]`, the host's torch float32 matmul GFLOPS and
what they allow for the forward (`prefill_bound_tok_s`, see `matmul_gflops`).

On an AVX-512 host this shows the AVX2 path too (`-march=x86-64-v3`), so every developer
sees both; ours losing an op to torch shows as `fastest[op] == "torch"`.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from asynchicache.bench.reports.output import (
    add_output_arguments,
    bench_parser,
    print_report,
    write_report,
)
from asynchicache.model import native
from asynchicache.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedAttention,
    PrefillSpan,
)
from asynchicache.model.loader import LoadedModel, load_model
from asynchicache.model.model_config import ModelConfig
from asynchicache.model.native import KernelThreads, KernelWork
from asynchicache.model.row_ops import NativeRowOps, RowOps
from asynchicache.model.runner import ForwardBatch, ModelRunner

REPORT = "kernels.json"
PAGE_SIZE = 16
DECODE_ROWS = 8  # sequences of a decode step (decode_attention)


@dataclass(frozen=True)
class KernelBenchArgs:
    model: str | None
    prompt_tokens: int
    threads: int
    repeats: int


def matmul_gflops(threads: int, size: int = 1024, seconds: float = 0.3) -> float:
    """torch's float32 matmul rate on this host at `threads` threads (GFLOPS): the best of
    square [size, size] products run for about `seconds`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)  # oneDNN/MKL pick and warm their kernel
        best, end = math.inf, time.perf_counter() + seconds
        while time.perf_counter() < end or best == math.inf:
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        return 2 * size**3 / best / 1e9
    finally:
        torch.set_num_threads(previous)


def prefill_flops(config: ModelConfig, tokens: int) -> float:
    """FLOPs of a whole-prompt forward of `tokens` tokens: every layer's projections and
    MLP, causal attention (scores and weighted V), the LM head for the last row."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    linear = 2 * tokens * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    attention = 2 * 2 * config.num_heads * config.head_dim * tokens * (tokens + 1) / 2
    return config.num_layers * (linear + attention) + 2 * h * config.vocab_size


def _threads(kernel: native.PagedAttentionKernel, workers: ThreadPoolExecutor) -> KernelThreads:
    return KernelThreads(kernel, workers if torch.get_num_threads() > 1 else None)


class OpArms:
    """One op's calls per arm at a prompt's shapes (random data of the model's widths)."""

    def __init__(self, config: ModelConfig, tokens: int, ops: dict[str, RowOps]) -> None:
        g = torch.Generator().manual_seed(0)
        c, t = config, tokens
        self.config, self.tokens, self.ops = config, tokens, ops
        self.x = torch.randn(t, c.hidden_size, generator=g)
        self.delta = torch.randn(t, c.hidden_size, generator=g)
        self.weight = 1 + 0.1 * torch.randn(c.hidden_size, generator=g)
        self.gate_up = torch.randn(t, 2 * c.intermediate_size, generator=g)
        heads = c.num_heads + 2 * c.num_kv_heads
        self.qkv = torch.randn(t, heads * c.head_dim, generator=g)
        angles = torch.randn(t, 1, c.head_dim // 2, generator=g)
        self.cos, self.sin = angles.cos(), angles.sin()
        pages = -(-t // PAGE_SIZE)
        self.pool = torch.zeros(pages, 1, 2, PAGE_SIZE, c.num_kv_heads, c.head_dim)
        self.pages = torch.arange(t) // PAGE_SIZE
        self.offsets = torch.arange(t) % PAGE_SIZE

    def calls(self, op: str) -> dict[str, Callable[[], object]]:
        """arm -> a call of `op` (arms: torch and every native build)."""
        c, t = self.config, self.tokens
        q_heads = c.num_heads + c.num_kv_heads
        rot = self.qkv[:, : q_heads * c.head_dim].view(t, q_heads, c.head_dim)
        v = self.qkv[:, q_heads * c.head_dim :].view(t, c.num_kv_heads, c.head_dim)
        made: dict[str, Callable[[], object]] = {}
        for arm, ops in self.ops.items():
            made[arm] = {
                "rms_norm": lambda o=ops: o.rms_norm(self.x, self.weight, 1e-5),
                "add_rms_norm": lambda o=ops: o.add_rms_norm(self.x, self.delta, self.weight, 1e-5),
                "silu_mul": lambda o=ops: o.silu_mul(self.gate_up),
                "rotary": lambda o=ops: o.rotary_(rot, self.cos, self.sin),
                "scatter": lambda o=ops: o.scatter_(
                    self.pool[:, 0, 1], v, self.pages, self.offsets
                ),
                "attention": lambda o=ops: self._attend(o),
                "decode_attention": lambda o=ops: self._attend_decode(o),
            }[op]
        return made

    def _attend(self, ops: RowOps) -> torch.Tensor:
        """One layer's attention over the whole prompt (its K/V written first, as a layer
        does), with the native kernel of `ops` or torch's SDPA."""
        c, t = self.config, self.tokens
        q = self.qkv[:, : c.q_size].view(t, c.num_heads, c.head_dim)
        k = self.qkv[:, c.q_size : c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
        v = self.qkv[:, c.q_size + c.kv_size :].view(t, c.num_kv_heads, c.head_dim)
        table = torch.arange(self.pool.shape[0])
        kernel = ops.threads if isinstance(ops, NativeRowOps) else None
        work = None
        if kernel is not None:
            items = torch.tensor([[0, 0, t, 0]])
            group = c.num_heads // c.num_kv_heads
            tasks = KernelWork.count_tasks([t], c.num_kv_heads, group)
            work = KernelWork(table, items, 1 / math.sqrt(c.head_dim), tasks)
        span = PrefillSpan(0, t, 0, table)
        meta = AttentionMetadata(self.pages, self.offsets, (span,), (), work)
        return PagedAttention(self.pool, meta, (None,), kernel, ops).attend(0, q, k, v)

    def _attend_decode(self, ops: RowOps) -> torch.Tensor:
        """One layer's attention of DECODE_ROWS sequences' new tokens, each over the whole
        prompt's keys (a decode step of a batch sharing the pool's pages)."""
        c, t, n = self.config, self.tokens, DECODE_ROWS
        q = self.qkv[:n, : c.q_size].view(n, c.num_heads, c.head_dim)
        k = self.qkv[:n, c.q_size : c.q_size + c.kv_size].view(n, c.num_kv_heads, c.head_dim)
        v = self.qkv[:n, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)
        pages = self.pool.shape[0]
        kernel = ops.threads if isinstance(ops, NativeRowOps) else None
        work = None
        # Each row the last position of the prompt (its slot rewritten: the same keys).
        last = torch.full((n,), t - 1)
        if kernel is not None:
            items = torch.tensor([[0, i, 1, t - 1] for i in range(n)])
            tasks = KernelWork.count_tasks([1] * n, c.num_kv_heads, c.num_heads // c.num_kv_heads)
            work = KernelWork(torch.arange(pages), items, 1 / math.sqrt(c.head_dim), tasks)
        group = DecodeGroup(
            torch.arange(n), torch.arange(pages).repeat(n), torch.full((n,), t), pages, True
        )
        meta = AttentionMetadata(last // PAGE_SIZE, last % PAGE_SIZE, (), (group,), work)
        return PagedAttention(self.pool, meta, (None,), kernel, ops).attend(0, q, k, v)


OPS = ("attention", "decode_attention", "rms_norm", "add_rms_norm", "silu_mul", "rotary", "scatter")


def interleaved_best(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Fastest seconds of each run, taking turns (one warm-up round first)."""
    best = {name: math.inf for name in runs}
    for round_ in range(repeats + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds = time.perf_counter() - start
            if round_ > 0:
                best[name] = min(best[name], seconds)
    return best


def forward_calls(
    loaded: LoadedModel, tokens: int, kernels: dict[str, KernelThreads | None]
) -> dict[str, Callable[[], object]]:
    """arm -> one whole prefill of a `tokens` prompt through a runner of that arm."""
    c = loaded.config
    pages = -(-tokens // PAGE_SIZE)
    pool = torch.zeros(pages, c.num_layers, 2, PAGE_SIZE, c.num_kv_heads, c.head_dim)
    ids = [(7 * i + 3) % c.vocab_size for i in range(tokens)]
    batch = ForwardBatch([ids], [0], [list(range(pages))])
    calls: dict[str, Callable[[], object]] = {}
    for arm, kernel in kernels.items():
        calls[arm] = functools.partial(
            ModelRunner(loaded.model, pool, PAGE_SIZE, kernel).forward, batch
        )
    return calls


def collect(args: KernelBenchArgs) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    builds = {name: native.load(name) for name in native.runnable_isas()}
    available = {name: k for name, k in builds.items() if k is not None}
    seconds: dict[str, dict[str, float]] = {}
    with ThreadPoolExecutor(max(1, args.threads - 1), thread_name_prefix="bench") as workers:
        threads = {name: _threads(k, workers) for name, k in available.items()}
        ops: dict[str, RowOps] = {"torch": RowOps()}
        ops |= {name: NativeRowOps(t) for name, t in threads.items()}
        arms = OpArms(loaded.config, args.prompt_tokens, ops)
        with torch.inference_mode():
            for op in OPS:
                seconds[op] = interleaved_best(arms.calls(op), args.repeats)
            kernels: dict[str, KernelThreads | None] = {"torch": None, **threads}
            calls = forward_calls(loaded, args.prompt_tokens, kernels)
            seconds["forward"] = interleaved_best(calls, args.repeats)
    gflops = matmul_gflops(args.threads)
    flops = prefill_flops(loaded.config, args.prompt_tokens)
    forward = seconds["forward"]
    return {
        "model": loaded.name,
        "threads": args.threads,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "prompt_tokens": args.prompt_tokens,
        "host_isa": native.host_isa().name,
        "builds": sorted(available),
        "seconds": {
            op: {a: round(s, 5) for a, s in arms_.items()} for op, arms_ in seconds.items()
        },
        "fastest": {op: min(arms_, key=arms_.__getitem__) for op, arms_ in seconds.items()},
        "prefill_tok_s": {a: round(args.prompt_tokens / s, 1) for a, s in forward.items()},
        "matmul_gflops": round(gflops, 1),
        "prefill_gflop": round(flops / 1e9, 1),
        "prefill_bound_tok_s": round(args.prompt_tokens / (flops / (gflops * 1e9)), 1),
    }


def _parser() -> argparse.ArgumentParser:
    parser = bench_parser("asynchicache.bench.micro.kernels", __doc__)
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2)")
    parser.add_argument("--prompt-tokens", type=int, default=1557)
    parser.add_argument("--threads", type=int, default=1, help="torch and kernel threads")
    parser.add_argument("--repeats", type=int, default=3)
    add_output_arguments(parser, REPORT)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    args = KernelBenchArgs(ns.model, ns.prompt_tokens, ns.threads, ns.repeats)
    record = collect(args)
    write_report(ns.out, REPORT, record)
    print_report(ns, record, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
