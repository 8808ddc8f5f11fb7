"""`python -m asynchicache.tools.op_choice_cli [--model M] [--threads N]`: measure this
host's choice of ours or torch's per op anew (model/op_choice.py) and record it
over the old one; prints it.

Run it on a quiet machine: the record names every later start's pages (a choice measured
on busy cores is kept until this is run again). It lives beside the engine, not in
models/, because it loads a model and times whole prefills through the runner.
"""

from __future__ import annotations

import argparse
import json
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from asynchicache.model import native
from asynchicache.model.loader import load_model
from asynchicache.model.native import KernelThreads
from asynchicache.model.op_choice import FORWARD_TOKENS, record_path, remeasure
from asynchicache.model.runner import prefill_timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynchicache.tools.op_choice_cli")
    parser.add_argument("--model", default=None, help="HF folder or GGUF (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (the engine's)")
    parser.add_argument("--budget-s", type=float, default=3.0)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    loaded = load_model(ns.model)
    kernel = native.load()
    if kernel is None:
        print("no native kernels here: torch's ops everywhere")
        return 1
    cores = torch.get_num_threads()
    with ThreadPoolExecutor(max(1, cores - 1)) as workers:
        threads = KernelThreads(kernel, workers if cores > 1 else None)
        prefill = prefill_timer(loaded.model, threads, FORWARD_TOKENS)
        choice = remeasure(threads, loaded.config, ns.budget_s, prefill, replace=True)
        record = record_path(threads, loaded.config)
        print(json.dumps({"build": kernel.isa, "record": str(record), "op_choice": choice.table()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
