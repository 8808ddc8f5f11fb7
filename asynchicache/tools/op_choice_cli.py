"""`python -m asynchicache.tools.op_choice_cli [--model M] [--threads N]`: measure this
host's choice of ours or torch's per op anew (model/op_choice.py) and record it
over the old one; prints it.

Run it on a quiet machine: the record names every later start's pages (a choice measured
on busy cores is kept until this is run again). It lives beside the engine, not in
models/, because it loads a model and times whole prefills through the runner.

It measures in the engine process's environment: OpenMP's wait policy and glibc's
malloc settings (launch/openmp.py, launch/allocator.py) are read once as those
libraries load, so where they are missing it runs itself again with them (a choice
measured with OpenMP's threads spinning was read by servers whose threads sleep).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

from asynchicache.launch.allocator import allocator_env
from asynchicache.launch.openmp import openmp_env
from asynchicache.model.loader import load_model
from asynchicache.model.op_choice import FORWARD_TOKENS, record_path, remeasure
from asynchicache.model.runner import attention_kernel, prefill_timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynchicache.tools.op_choice_cli")
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (the engine's)")
    parser.add_argument("--budget-s", type=float, default=3.0)
    ns = parser.parse_args(argv)
    if argv is None:
        _in_engine_environment()
    logging.basicConfig(level=logging.INFO)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    loaded = load_model(ns.model)
    threads = attention_kernel(loaded.config, torch.float32, torch.device("cpu"))
    if threads is None:
        print("no native kernels here: torch's ops everywhere")
        return 1
    prefill = prefill_timer(loaded.model, threads, FORWARD_TOKENS)
    choice = remeasure(threads, loaded.config, ns.budget_s, prefill, replace=True)
    record = record_path(threads, loaded.config)
    build = threads.kernel.isa
    print(json.dumps({"build": build, "record": str(record), "op_choice": choice.table()}))
    return 0


def _in_engine_environment() -> None:
    """Run this command again with the engine process's OpenMP and allocator settings
    where they are missing (module docstring); returns where nothing is missing."""
    extra = dict(openmp_env(os.environ) + allocator_env(os.environ))
    if extra:
        argv = [sys.executable, "-m", "asynchicache.tools.op_choice_cli", *sys.argv[1:]]
        os.execve(sys.executable, argv, {**os.environ, **extra})


if __name__ == "__main__":
    raise SystemExit(main())
