"""vLLM's own `bench serve` against our server: `--backend openai`, its tokenizer lined up
with ours through /tokenize and /detokenize, and no tokenizer warning.

Our server runs from the main venv (as users run it); the benchmark from this one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asynchicache.bench.server_process import BenchServer

REPO = Path(__file__).resolve().parents[2]
SERVED = "smollm2"
BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@pytest.mark.timeout(900)  # a model load and a benchmark on a shared CPU
def test_vllm_bench_serve_runs_against_our_server(smollm_hf: Path, tmp_path: Path) -> None:
    serve = [str(REPO / ".venv" / "bin" / "python"), "-m", "asynchicache", "serve",
             "--port", "{port}", "--device", "cpu", "--served-model-name", SERVED,
             "--no-disk-cache"]  # the embedded GGUF: `smollm_hf` is its export  # fmt: skip
    with BenchServer([], tmp_path / "server.log", env={"PYTHONPATH": str(REPO)},
                     command=serve) as server:  # fmt: skip
        argv = ["--backend", "openai", "--base-url", server.url, "--model", SERVED,
                "--tokenizer", str(smollm_hf), "--dataset-name", "random", "--num-prompts", "6",
                "--random-input-len", "96", "--random-output-len", "4", "--max-concurrency", "3",
                "--temperature", "0"]  # fmt: skip
        offline = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        bench = subprocess.run([sys.executable, "-c", BENCH, *argv], capture_output=True,
                               text=True, timeout=600, cwd=tmp_path, env=offline)  # fmt: skip
    out = bench.stdout + bench.stderr
    assert bench.returncode == 0, out[-4000:]
    assert "Successful requests:                     6" in out, out[-4000:]
    for warning in ("/tokenize unavailable", "tokenizer mismatch"):
        assert warning not in out, out[-4000:]
    assert "WARNING" not in out.replace("WARNING: vllm bench serve no longer sets", ""), out[-4000:]
