"""How a step's shape moves the forward's pace: prompt chunking and long-context decodes.

    python -m asynchicache.bench.micro.step_shapes [--prompt-tokens 1032] [--batch 4,16]
        [--repeats 5] [--model PATH]

In this process, the model's own runner with the native attention kernel (where it
builds), OpenMP's wait policy as the engine process has it (set it before running:
`OMP_WAIT_POLICY=PASSIVE`, launch/openmp.py):

* prefill of one `--prompt-tokens` prompt on 2 threads (every core, at most 2) in
  chunks of 256, in chunks of 512 (the server's default `--chunked-prefill-size`),
  whole, and two such prompts in one step: tokens per second;
* one decode step of `--batch` requests, each over the whole prompt, at 1 and at 2
  threads: milliseconds a step, the attention kernel's share of it, and the KV it
  read (beside the weights' bytes, also printed).

Prints one JSON object with the medians of `--repeats` runs and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

CHUNKINGS = {"chunks_256": 256, "chunks_512": 512, "whole": 0}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynchicache.bench.micro.step_shapes")
    parser.add_argument("--prompt-tokens", type=int, default=1032)
    parser.add_argument("--batch", default="4,16", help="decode batch sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="GGUF or HF folder (default: SmolLM2)")
    return parser


def _median_s(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(
    model: str | None, prompt_tokens: int, batches: Sequence[int], repeats: int
) -> dict[str, Any]:
    import torch

    from asynchicache.bench.engine_speed import new_runner, prompt_ids
    from asynchicache.hierarchy.pools import KVLayout
    from asynchicache.model.loader import load_model
    from asynchicache.model.native import KernelThreads
    from asynchicache.model.runner import ForwardBatch, ModelRunner, attention_kernel

    loaded = load_model(model)
    seqs = max(2, *batches)
    base, tables = new_runner(loaded, prompt_tokens + 1, seqs)
    dtype = loaded.model.embed_tokens.weight.dtype
    kernel = attention_kernel(loaded.config, dtype, torch.device(loaded.device))
    runner = ModelRunner(loaded.model, base.kv_pool, base.page_size, kernel=kernel)
    ids = prompt_ids(loaded, prompt_tokens, 0)
    n = prompt_tokens

    def prefill(chunk: int, table: list[int]) -> None:
        size = chunk or n
        for start in range(0, n, size):
            runner.forward(ForwardBatch([ids[start : start + size]], [start], [table]))

    threads = min(2, len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    for table in tables:  # every sequence's KV in place (and a warm-up)
        prefill(512, table)
    out: dict[str, Any] = {"prompt_tokens": n, "prefill_threads": threads, "prefill_tok_s": {}}
    for name, chunk in CHUNKINGS.items():
        out["prefill_tok_s"][name] = round(
            n / _median_s(partial(prefill, chunk, tables[0]), repeats)
        )
    both = ForwardBatch([ids, ids], [0, 0], tables[:2])
    out["prefill_tok_s"]["two_prompts_one_step"] = round(
        2 * n / _median_s(lambda: runner.forward(both), repeats)
    )

    kernel_s = [0.0]

    class Timed(KernelThreads):
        """The kernel with its calls' wall time (every thread's part) added to kernel_s."""

        def run(self, *args: Any, **kwargs: Any) -> None:
            began = time.perf_counter()
            super().run(*args, **kwargs)
            kernel_s[0] += time.perf_counter() - began

    if kernel is not None:
        timed = Timed(kernel.kernel, kernel.workers)
        runner = ModelRunner(loaded.model, base.kv_pool, base.page_size, kernel=timed)
    c = loaded.config
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, base.page_size, dtype)
    kv_per_token = layout.page_bytes // base.page_size
    out["weight_bytes"] = loaded.weight_bytes
    out["decode"] = {}
    for b in batches:
        step = ForwardBatch([[ids[-1]]] * b, [n] * b, tables[:b])
        row: dict[str, Any] = {"kv_bytes": b * (n + 1) * kv_per_token}
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            runner.forward(step)
            kernel_s[0] = 0.0
            row[f"step_ms@{t}"] = round(1000 * _median_s(partial(runner.forward, step), repeats), 1)
            row[f"kernel_ms@{t}"] = round(1000 * kernel_s[0] / repeats, 1)
        out["decode"][f"batch_{b}"] = row
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    batches = [int(x) for x in args.batch.split(",") if x.strip()]
    report = {"load_avg_1m_before": os.getloadavg()[0]}
    report.update(measure(args.model, args.prompt_tokens, batches, args.repeats))
    report["load_avg_1m_after"] = os.getloadavg()[0]
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
