"""scripts/gpu-check.sh where there is no GPU: shellcheck, and its dry run end to end.

The dry run takes every step the GPU run takes (install into a private folder, the
machine's record, a random SmolLM2-shaped model, the CUDA-marked tests, bench engine,
the summary of the issue's bars) on the CPU with a 2-layer model and tiny sizes; the
CUDA tests are collected and skipped. Runs everywhere (no `cuda` mark).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asynchicache.tools.export_hf import export_hf

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [ROOT / "scripts" / "gpu-check.sh", ROOT / "scripts" / "gpu-prepare.sh"]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_gpu_scripts_pass_shellcheck() -> None:
    done = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_dry_run_takes_every_step_on_the_cpu(tmp_path: Path) -> None:
    gpu = tmp_path / "gpu"
    export = export_hf(tmp_path / "export")  # what gpu-prepare.sh leaves in .gpu/model
    (gpu / "model").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(export / name, gpu / "model" / name)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_DIR": str(gpu), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(SCRIPTS[0]), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] and summary["device"] == "cpu"
    tests = summary["tests"]
    assert tests["tests"] >= 10 and tests["skipped"] == tests["tests"], tests
    assert summary["bars"]["all_cuda_tests_pass"]
    engine = json.loads((out / "engine.json").read_text())
    for key in ("ttft_recompute_s", "ttft_l1_s", "ttft_l2_s", "ttft_l3_s", "l1_to_l2_GBps"):
        assert engine[key] > 0, key
    assert engine["bytes_equal"] and engine["ttft_l3_cached_tokens"] > 0
    assert "torch" in (out / "env.txt").read_text()
    # What comes back from a device call: at most 8 files, named plainly.
    assert len(list(out.iterdir())) <= 8
