"""The step-shape benchmark runs end to end (tiny model, tiny sizes) and prints its record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asynchicache.bench.micro.step_shapes import main


def test_step_shapes_prints_every_shape(
    tiny_checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(tiny_checkpoints["llama3-rope-tied"])
    threads = torch.get_num_threads()
    try:
        assert (
            main(["--model", model, "--prompt-tokens", "40", "--batch", "1,3", "--repeats", "1"])
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    assert set(report["prefill_tok_s"]) == {
        "chunks_256",
        "chunks_512",
        "whole",
        "two_prompts_one_step",
    }
    assert all(v > 0 for v in report["prefill_tok_s"].values())
    assert report["weight_bytes"] > 0
    rows = report["decode"]
    assert set(rows) == {"batch_1", "batch_3"}
    assert rows["batch_3"]["kv_bytes"] == 3 * rows["batch_1"]["kv_bytes"] > 0
    assert all(rows["batch_3"][f"step_ms@{t}"] > 0 for t in {1, report["prefill_threads"]})
