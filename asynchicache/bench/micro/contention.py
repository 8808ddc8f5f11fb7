"""How a step's thread count fares with other processes on the cores (engine/threads.py
chose its per-step rule from this).

    python -m asynchicache.bench.micro.contention [--repeats 5] [--model PATH]
        [--loads "quiet,0.3 core,1 core,1.5 cores,2 cores"] [--cached 1000] [--prefill 1024]

For each load beside it (none; 0.3 of a core in 2 ms bursts; one core; one and a half;
both), a fresh process with the engine process's environment (OpenMP's passive wait,
launch/openmp.py; the allocator settings, launch/allocator.py) loads the model and
times, alternating 1 and 2 threads, a `--prefill`-token step over `--cached` cached
tokens and a decode step of 8 requests over `--cached` tokens each (the mean of 10).
Prints one JSON object: per load and case, the median seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from asynchicache.bench.micro.openmp_wait import busy
from asynchicache.launch.allocator import allocator_env
from asynchicache.launch.openmp import openmp_env

# Busy shares of one core, one process each, beside the measured one.
LOADS: dict[str, tuple[float, ...]] = {
    "quiet": (),
    "0.3 core": (0.3,),
    "1 core": (1.0,),
    "1.5 cores": (1.0, 0.5),
    "2 cores": (1.0, 1.0),
}
BATCH, DECODE_REPEATS = 8, 10


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynchicache.bench.micro.contention")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="GGUF or HF folder (default: SmolLM2)")
    parser.add_argument("--loads", default=",".join(LOADS), help="comma-separated, of these")
    parser.add_argument("--cached", type=int, default=1000, help="tokens already in the pool")
    parser.add_argument("--prefill", type=int, default=1024, help="the prefill step's tokens")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--busy", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser


def step_times(
    model: str | None, repeats: int, cached: int, prefill_tokens: int
) -> dict[str, float]:
    """In this process: the two steps at 1 and 2 threads, median seconds."""
    import torch

    from asynchicache.bench.engine_speed import native_runner, prompt_ids
    from asynchicache.model.loader import load_model
    from asynchicache.model.runner import ForwardBatch

    loaded = load_model(model)
    runner, tables = native_runner(loaded, cached + prefill_tokens + 1, BATCH)
    ids = prompt_ids(loaded, cached + prefill_tokens, 0)
    for table in tables:
        runner.forward(ForwardBatch([ids[:cached]], [0], [table]))
    prefill = ForwardBatch([ids[cached:]], [cached], tables[:1])
    decode = ForwardBatch([[ids[cached]]] * BATCH, [cached] * BATCH, tables)
    cases: dict[str, tuple[Callable[[], Any], int]] = {
        f"prefill_{prefill_tokens}": (lambda: runner.forward(prefill), 1),
        f"decode_{BATCH}": (lambda: runner.forward(decode), DECODE_REPEATS),
    }
    seen: dict[str, list[float]] = {}
    for _ in range(repeats):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, (run, times) in cases.items():
                began = time.perf_counter()
                for _ in range(times):
                    run()
                seen.setdefault(f"{name}@{threads}", []).append(
                    (time.perf_counter() - began) / times
                )
    return {k: round(statistics.median(v), 4) for k, v in seen.items()}


def _under(load: tuple[float, ...], args: argparse.Namespace) -> dict[str, float]:
    me = [sys.executable, "-m", "asynchicache.bench.micro.contention"]
    beside = [subprocess.Popen([*me, "--busy", str(duty)]) for duty in load]
    env = dict(os.environ)
    env.update(openmp_env(os.environ) + allocator_env(os.environ))
    argv = [*me, "--child", "--repeats", str(args.repeats), "--cached", str(args.cached),
            "--prefill", str(args.prefill)]  # fmt: skip
    argv += ["--model", args.model] if args.model else []
    try:
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    finally:
        for proc in beside:
            proc.kill()
            proc.wait()
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.busy > 0:
        busy(args.busy)
        return 0
    if args.child:
        print(json.dumps(step_times(args.model, args.repeats, args.cached, args.prefill)))
        return 0
    report: dict[str, Any] = {"load_avg_1m_before": os.getloadavg()[0]}
    names = [n.strip() for n in args.loads.split(",") if n.strip()]
    unknown = [n for n in names if n not in LOADS]
    if unknown:
        raise SystemExit(f"unknown loads {unknown}; known: {', '.join(LOADS)}")
    report["loads"] = {name: _under(LOADS[name], args) for name in names}
    report["load_avg_1m_after"] = os.getloadavg()[0]
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
