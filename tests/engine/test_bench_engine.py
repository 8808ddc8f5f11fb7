"""The engine benchmark runs end to end (tiny model, tiny sizes) and prints its record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asynchicache.bench.engine_speed import main
from asynchicache.model import native


def test_bench_prints_one_json_record(
    tiny_checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--model",
        str(tiny_checkpoints["qwen2"]),
        "--threads",
        "1",
        "--prompt-tokens",
        "64",
        "--decode-tokens",
        "4",
        "--batch",
        "3",
        "--repeats",
        "1",
    ]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "prefill_tok_s",
        "hf_prefill_tok_s",
        "decode_b1_tok_s",
        "decode_b3_tok_s",
        "hf_decode_b1_tok_s",
        "ttft_recompute_s",
        "ttft_l1_s",
        "ttft_l2_s",
        "ttft_l3_s",
        "dd_read_cold_GBps",
        "ttft_l3_bound_s",
        "torch_prefill_tok_s",
        "matmul_gflops",
        "prefill_bound_tok_s",
        "prefill_of_bound",
    ):
        assert record[key] > 0, key
    # Which kernel ran (the tiny model's head_dim 16 fits the native kernels).
    assert record["kernel"] in native.runnable_isas() and record["kernel_lanes"] in (8, 16)
    # The L3 hit's yardstick, measured in the same run: 4 pages of the tiny model's KV.
    assert record["kv_bytes"] == 4 * (2 * 2 * 16 * 2 * 16 * 4)  # pages x (layers, K/V, ...)
    for tier in ("l1", "l2", "l3"):  # every tier served the whole prompt; its last token computes
        assert record[f"ttft_{tier}_cached_tokens"] == 63, tier
    assert record["model"] == tiny_checkpoints["qwen2"].name
    assert record["prompt_tokens"] == 64
