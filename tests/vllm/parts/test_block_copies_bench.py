"""`python -m asynchicache.integrations.vllm.layouts.block_copies_bench`, end to end on a
small shape."""

from __future__ import annotations

import json

import pytest

from asynchicache.integrations.vllm.layouts import block_copies_bench


def test_the_bench_times_both_ways_of_each_copy(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--tokens", "64", "--repeats", "2", "--layers", "2", "--block-size", "32"]
    argv += ["--kv-heads", "2", "--head-dim", "8", "--page-size", "8"]
    assert block_copies_bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 64
    # 8 pages of [2 layers, K and V, 8 tokens, 2 heads, 8 dims] float32
    assert out["bytes"] == 8 * 2 * 2 * 8 * 2 * 8 * 4
    for copy in ("save", "load"):
        for way in ("consecutive", "scattered"):
            assert out[f"{copy}_{way}_ms"] > 0
            assert out[f"{copy}_{way}_GBps"] > 0


def test_the_bench_times_the_amx_kernels_tiles(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--tokens", "64", "--repeats", "1", "--layers", "2", "--block-size", "32"]
    argv += ["--kv-heads", "2", "--head-dim", "32", "--page-size", "16", "--kernel", "amx"]
    assert block_copies_bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kernel"] == "amx"
    assert out["bytes"] == 4 * 2 * 2 * 16 * 2 * 32 * 2  # 4 pages, bfloat16
    assert out["load_consecutive_ms"] > 0 and out["save_scattered_ms"] > 0
