"""A real vLLM at tensor-parallel size 2 on CPU with our connector (the tiny model: 2 KV
heads, one per rank).

Each rank's worker copies its own head of every page into (and out of) its slice
of the shared L2 slots; the scheduler publishes a page once both ranks reported
it. A prompt computed cold and the same prompt loaded from L2 give the same
answer. (Per-rank slices byte for byte: test_scheduling_modes.py::
test_tensor_parallel_ranks_save_and_load_their_own_heads.) vLLM's CPU backend
binds each rank's threads to a NUMA node unless told which cores to use: one
core per rank here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tiny_pair import TinyPair
from vllm_helpers import CONNECTOR, connector_config, hit_after, hits, prompt, text_of

from asynchicache.bench.processes.vllm_process import VllmFlags, VllmServer

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]

N = 700
SHM = Path("/dev/shm")
LOADED = N // 16 * 16


def test_two_ranks_save_and_load_their_own_heads(
    tiny_pair: TinyPair, tiny_hf: Path, tmp_path: Path
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "TP 2 on CPU needs two cores"
    tiny_pair.stop()  # at most two vLLM servers' worth of processes at once
    # a tiny model: test the mechanics, not the rates (load_policy always)
    extra_config = connector_config(
        tmp_path / "kv", f"ipc://{tmp_path}/run/c.sock", 0.05, load_policy="always"
    )
    flags = VllmFlags(
        tiny_hf,
        kv_cache_bytes=32 << 20,
        connector=CONNECTOR,
        extra_config=extra_config,
        extra=("--tensor-parallel-size", "2"),
    )
    bind = f"{cores[0]}|{cores[1]}"
    s = VllmServer(flags, tmp_path / "vllm.log", env={"VLLM_CPU_OMP_THREADS_BIND": bind})
    shm_before = set(SHM.iterdir())
    try:
        s.start()
        p = prompt(70, N)
        cold = text_of(s, p, max_tokens=12)
        host = hits(s, "host")
        s.reset_prefix_cache()  # only our L2 holds the prompt's pages now
        assert text_of(s, p, max_tokens=12) == cold
        assert hit_after(s, "host", host, LOADED) == LOADED
    finally:
        s.stop()
        # vLLM's CPU communicator between the ranks leaves its shared memory behind
        # (vllm_dist_*-cpushm_<rank>, 4 MiB each) when the server stops: ours to remove.
        for left in set(SHM.iterdir()) - shm_before:
            if left.name.startswith("vllm_dist_"):
                left.unlink(missing_ok=True)
    log = (tmp_path / "vllm.log").read_text()
    assert "/tp2" in log  # the namespace names the TP size
    assert "backend_mismatch" not in log  # both ranks run the backend the pages name
