"""Time to first token of a long prompt, recomputed and served from each tier.

    python -m asynchicache.bench.ttft [--prompt-tokens 2048] [--model PATH]

Everything is measured in one run on one model: `ttft_recompute_s` (no prefix
cache), `ttft_l1_s` (the prefix on L1), `ttft_l2_s` (L1 emptied, the prefix on
L2), `ttft_l3_s` (a new engine and a new cache service over the same disk
folder: the restart case; the page cache of the files is dropped first with
posix_fadvise, so the read is cold when the kernel honours it). The cache
service runs in a process of its own, as the server runs it (in a thread of
this process it would take the interpreter lock from the engine's loop).

The hits are the KV tiers' (a prompt's kept last logits, engine/sampling/prompt_logits.py,
are off here: they would answer the first token of a repeat without the tiers).
Every engine warms up first as the server's does at start-up (`Engine.warm_up`).
A hit takes tens of milliseconds, so one sample of it is at the mercy of
whatever else ran in that moment: each hit figure is the median of `HIT_SAMPLES`
(each L2 sample empties L1 again, each L3 sample restarts again). The recompute
takes seconds and is measured once.

Next to them, measured in the same run: `kv_bytes` (the prompt's full pages,
what an L3 hit reads) and `dd_read_cold_GBps`, the disk folder's cold read
bandwidth as `dd` measures it (`bench/processes/dd.py`), so an L3 hit can be judged
against the disk's own pace: `ttft_l3_bound_s` = kv_bytes / that bandwidth +
`ttft_l1_s`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from asynchicache.bench.processes.dd import cold_read
from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import GenerateRequest, SamplingParams
from asynchicache.launch.launch import ServiceLaunch, run_cache_service
from asynchicache.model.loader import LoadedModel, load_model
from asynchicache.settings.config import CacheConfig, EngineConfig
from asynchicache.storage.client.client_config import ClientConfig
from asynchicache.storage.client.storage_client import StorageClient
from asynchicache.storage.service.server import ServiceConfig

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
HIT_SAMPLES = 3


def time_to_first_token(engine: Engine, prompt: list[int]) -> tuple[float, object]:
    """Seconds from submit to the first token; returns the final output too."""
    rid = f"ttft-{time.monotonic_ns()}"
    start = time.perf_counter()
    early = engine.add_request(GenerateRequest(rid, tuple(prompt), FIRST_TOKEN))
    if early is not None:
        raise RuntimeError(early.error)
    while True:
        for out in engine.step():
            if out.rid == rid and out.token_ids:
                return time.perf_counter() - start, out
        if not engine.scheduler.running:
            time.sleep(0.0002)  # only loads in flight


def real_text_prompt(model: LoadedModel, n_tokens: int, seed: int = 0) -> list[int]:
    """A prompt of exactly n_tokens from English-like text (not random ids)."""
    rng = random.Random(seed)
    words = (
        "the river harbour winter lantern quiet market engine letter garden stone "
        "morning shadow bridge window journey silver paper orchard signal"
    ).split()
    text = " ".join(rng.choice(words) for _ in range(n_tokens * 2))
    # Tiny test models have a smaller vocabulary than their tokenizer.
    ids = [t % model.config.vocab_size for t in model.tokenizer.encode(text)]
    if len(ids) < n_tokens:
        raise ValueError("text too short for the requested prompt length")
    return ids[:n_tokens]


def _drop_page_cache(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@dataclass
class _DiskEngine:
    """An engine over a cache service process of its own (the server's arrangement)."""

    engine: Engine
    service: BaseProcess

    def close(self) -> None:
        _close(self.engine)
        self.service.terminate()  # SIGTERM: it finishes its writes and exits
        self.service.join(30)
        if self.service.exitcode is None:
            self.service.kill()
            self.service.join(5)


def _disk_engine(model: LoadedModel, folder: Path, cache: CacheConfig) -> _DiskEngine:
    service = ServiceConfig(folder / "kv", address=f"ipc://{folder}/svc.sock")
    proc = mp.get_context("spawn").Process(
        target=run_cache_service, args=(ServiceLaunch(service, "warning"),), daemon=True
    )
    proc.start()
    client = StorageClient(ClientConfig(service.address))
    # The tiers' KV paths are measured: a repeat's first token from kept logits
    # (engine/sampling/prompt_logits.py) would skip them.
    engine = Engine(_engine_config(model), cache, storage=client, loaded=model)
    made = _DiskEngine(engine, proc)
    if not client.wait_ready(60):
        made.close()
        raise RuntimeError("cache service did not come up")
    made.engine.warm_up()
    return made


def _engine_config(model: LoadedModel) -> EngineConfig:
    """The engine on the model's device and dtype (L1 lives there too)."""
    return EngineConfig(device=model.device, dtype=model.dtype, prompt_logits_mib=0)


def _close(engine: Engine) -> None:
    engine.close()
    if engine.cache.storage is not None:
        engine.cache.storage.close()


def _median_hit(samples: list[tuple[float, object]]) -> tuple[float, object]:
    """The median seconds of the samples, with the output of the first (all are checked)."""
    first = samples[0][1]
    for _, out in samples[1:]:
        if out.token_ids != first.token_ids:  # type: ignore[attr-defined]
            raise RuntimeError("two hits of one tier gave different first tokens")
    return statistics.median(seconds for seconds, _ in samples), first


def _l2_hit(engine: Engine, prompt: list[int]) -> tuple[float, object]:
    engine.cache.evict(engine.cache.stats().device.total)
    return time_to_first_token(engine, prompt)


def _l3_hit(
    model: LoadedModel, folder: Path, cache: CacheConfig, prompt: list[int]
) -> tuple[float, object]:
    """A restart: a new engine and cache service over the same disk folder, read cold."""
    _drop_page_cache(folder / "kv")
    made = _disk_engine(model, folder, cache)
    try:
        return time_to_first_token(made.engine, prompt)
    finally:
        made.engine.cache.drain()  # its write-backs land before the next restart reads
        made.close()


def measure(model: LoadedModel, prompt_tokens: int = 2048) -> dict[str, Any]:
    prompt = real_text_prompt(model, prompt_tokens)
    results: dict[str, Any] = {}
    plain = Engine(
        _engine_config(model),
        CacheConfig(enable_prefix_cache=False, disk_cache_dir=None),
        loaded=model,
    )
    plain.warm_up()
    results["ttft_recompute_s"], expected = time_to_first_token(plain, prompt)
    _close(plain)
    n = HIT_SAMPLES
    with tempfile.TemporaryDirectory(prefix="asynchicache-ttft-") as tmp:
        folder = Path(tmp)
        cache = CacheConfig(
            disk_cache_dir=folder / "kv",
            device_cache_tokens=prompt_tokens * 2,
            host_cache_gb=prompt_tokens * 2 * 50e3 / 2**30,
        )
        made = _disk_engine(model, folder, cache)
        engine = made.engine
        try:
            time_to_first_token(engine, prompt)  # cold: computes and writes every tier
            engine.cache.drain()
            hits = {"l1": _median_hit([time_to_first_token(engine, prompt) for _ in range(n)])}
            hits["l2"] = _median_hit([_l2_hit(engine, prompt) for _ in range(n)])
            engine.cache.drain()
        finally:
            made.close()
        hits["l3"] = _median_hit([_l3_hit(model, folder, cache, prompt) for _ in range(n)])
        kv_bytes = (prompt_tokens // cache.page_size) * engine.layout.page_bytes
        results.update(cold_read(folder, kv_bytes).report())
    for name, (seconds, out) in hits.items():
        if out.token_ids != expected.token_ids:  # type: ignore[attr-defined]
            raise RuntimeError(f"first token from {name} differs from the recomputed one")
        results[f"ttft_{name}_s"] = seconds
        results[f"ttft_{name}_cached_tokens"] = out.cached.total  # type: ignore[attr-defined]
    results["prompt_tokens"] = prompt_tokens
    results["hit_samples"] = n
    results["kv_bytes"] = kv_bytes
    results["ttft_l3_bound_s"] = (
        kv_bytes / (results["dd_read_cold_GBps"] * 1e9) + (results["ttft_l1_s"])
    )
    results["ttft_l3_vs_bound"] = results["ttft_l3_s"] / results["ttft_l3_bound_s"]
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynchicache.bench.ttft", description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    model = load_model(args.model)
    print(json.dumps(measure(model, args.prompt_tokens), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
