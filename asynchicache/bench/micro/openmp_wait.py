"""How OpenMP's wait policy moves our forward at one and two threads, with other work on
the cores (launch/openmp.py chose PASSIVE from this).

    python -m asynchicache.bench.micro.openmp_wait [--duty 0.3] [--repeats 7] [--model PATH]

For each setting (OpenMP's default spin, `OMP_WAIT_POLICY=PASSIVE`,
`GOMP_SPINCOUNT=20000`) a fresh process loads the model (the runtime reads the
setting as it loads) and times, alternating 1 and 2 threads, a 512-token chunk
over 512 cached tokens and a 64-token step over 1,000. `--duty` > 0 runs a
process beside it that keeps that share of one core busy in 2 ms bursts (what
the HTTP process, the cache service and a streaming client do to the engine in
a pressure run). Prints one JSON object: per setting and case, the best and
median seconds.
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

SETTINGS = {
    "spin (default)": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=20000": {"GOMP_SPINCOUNT": "20000"},
}
BURST_S = 0.002


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynchicache.bench.micro.openmp_wait")
    parser.add_argument("--duty", type=float, default=0.0, help="busy share of one core beside")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default=None, help="GGUF or HF folder (default: SmolLM2)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--busy", action="store_true", help=argparse.SUPPRESS)
    return parser


def busy(duty: float) -> None:
    """Keep `duty` of one core busy in bursts until killed."""
    while True:
        began = time.perf_counter()
        while time.perf_counter() - began < BURST_S:
            pass
        time.sleep(BURST_S * (1 - duty) / duty)


def forward_times(model: str | None, repeats: int) -> dict[str, dict[str, float]]:
    """In this process: the two cases at 1 and 2 threads, best and median seconds."""
    import torch

    from asynchicache.bench.engine_speed import native_runner, prompt_ids
    from asynchicache.model.loader import load_model
    from asynchicache.model.runner import ForwardBatch

    loaded = load_model(model)
    runner, tables = native_runner(loaded, 1100, 1)
    ids = prompt_ids(loaded, 1100, 0)
    runner.forward(ForwardBatch([ids[:1000]], [0], tables))
    cases: dict[str, Callable[[], Any]] = {
        "chunk512": lambda: runner.forward(ForwardBatch([ids[512:1024]], [512], tables)),
        "step64": lambda: runner.forward(ForwardBatch([ids[1000:1064]], [1000], tables)),
    }
    seen: dict[str, list[float]] = {}
    for _ in range(repeats):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, run in cases.items():
                began = time.perf_counter()
                run()
                seen.setdefault(f"{name}@{threads}", []).append(time.perf_counter() - began)
    return {
        k: {"best_s": round(min(v), 4), "median_s": round(statistics.median(v), 4)}
        for k, v in seen.items()
    }


def _child(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    argv = [sys.executable, "-m", "asynchicache.bench.micro.openmp_wait", "--child",
            "--repeats", str(args.repeats)]  # fmt: skip
    argv += ["--model", args.model] if args.model else []
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(argv, env={**clean, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.busy:
        busy(args.duty)
        return 0
    if args.child:
        print(json.dumps(forward_times(args.model, args.repeats)))
        return 0
    beside = None
    if args.duty > 0:
        beside = subprocess.Popen([sys.executable, "-m", "asynchicache.bench.micro.openmp_wait",
                                   "--busy", "--duty", str(args.duty)])  # fmt: skip
    try:
        report = {
            "duty": args.duty,
            "load_avg_1m_before": os.getloadavg()[0],
            "settings": {name: _child(args, env) for name, env in SETTINGS.items()},
            "load_avg_1m_after": os.getloadavg()[0],
        }
    finally:
        if beside is not None:
            beside.kill()
            beside.wait()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
