"""The engine benchmark runs end to end (tiny model, tiny sizes) and prints its record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asynchicache.bench.engine import main


def test_bench_prints_one_json_record(
    tiny_checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", str(tiny_checkpoints["qwen2"]), "--threads", "1", "--prompt-tokens", "64",
            "--decode-tokens", "4", "--batch", "3", "--repeats", "1"]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("prefill_tok_s", "hf_prefill_tok_s", "decode_b1_tok_s", "decode_b3_tok_s",
                "hf_decode_b1_tok_s"):
        assert record[key] > 0, key
    assert record["model"] == tiny_checkpoints["qwen2"].name
    assert record["prompt_tokens"] == 64
