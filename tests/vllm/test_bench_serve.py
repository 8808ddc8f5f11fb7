"""vLLM's own tools against our server: `bench serve` (`--backend openai`, its tokenizer
lined up with ours through /tokenize and /detokenize) prints no tokenizer warning, and
our /metrics carries vLLM 0.32's metric names with the types and labels its metrics
module declares (so its Grafana dashboard reads us).

Our server runs from the main venv (as users run it); the benchmark from this one.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asynchicache.bench.processes.server_process import BenchServer
from asynchicache.server.compat_metrics import PEER_METRICS

pytestmark = pytest.mark.timeout(900)  # a model load and a benchmark on a shared CPU
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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BenchServer]:
    serve = [str(REPO / ".venv" / "bin" / "python"), "-m", "asynchicache", "serve",
             "--port", "{port}", "--device", "cpu", "--served-model-name", SERVED,
             "--no-disk-cache"]  # the embedded GGUF: `smollm_hf` is its export  # fmt: skip
    log = tmp_path_factory.mktemp("bench-serve") / "server.log"
    with BenchServer([], log, env={"PYTHONPATH": str(REPO)}, command=serve) as srv:
        yield srv


def test_vllm_bench_serve_runs_against_our_server(
    server: BenchServer, smollm_hf: Path, tmp_path: Path
) -> None:
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


def _vllm_declared() -> dict[str, tuple[str, tuple[str, ...] | None]]:
    """name -> (type, label names) of every metric vLLM's metrics module declares."""
    from vllm.v1.metrics import loggers

    out: dict[str, tuple[str, tuple[str, ...] | None]] = {}
    for node in ast.walk(ast.parse(inspect.getsource(loggers))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        kind = {"_counter_cls": "counter", "_gauge_cls": "gauge",
                "_histogram_cls": "histogram"}.get(node.func.attr)  # fmt: skip
        kw = {k.arg: k.value for k in node.keywords}
        name = kw.get("name")
        if kind and isinstance(name, ast.Constant) and str(name.value).startswith("vllm:"):
            out[str(name.value)] = (kind, _label_names(kw.get("labelnames")))
    return out


def _label_names(node: ast.expr | None) -> tuple[str, ...] | None:
    """`labelnames` (["model_name", "engine"]) or `labelnames + ["x"]`; None otherwise."""
    if isinstance(node, ast.Name) and node.id == "labelnames":
        return ("model_name", "engine")
    if isinstance(node, ast.BinOp) and isinstance(node.right, ast.List):
        base = _label_names(node.left)
        extra = tuple(str(e.value) for e in node.right.elts if isinstance(e, ast.Constant))
        return None if base is None else (*base, *extra)
    return None


def test_our_metrics_carry_vllms_names_types_and_labels(server: BenchServer) -> None:
    declared = _vllm_declared()
    assert len(declared) > 30, "vLLM's metrics module no longer declares what it did"
    ours = [row for row in PEER_METRICS if row.peer == "vLLM"]
    for row in ours:
        assert row.name in declared, f"{row.name} is not a vLLM 0.32 metric"
        assert declared[row.name] == (row.kind, row.labels), row.name
    httpx.post(server.url + "/v1/completions", timeout=120,
               json={"prompt": "Hello there, how", "max_tokens": 2})  # fmt: skip
    text = httpx.get(server.url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # (prometheus_client's `_created` series parse as families of their own)
    exported = {n for n in families if n.startswith("vllm:") and not n.endswith("_created")}
    assert exported == {row.name for row in ours}, "a vllm: name that vLLM does not have"
    for row in ours:
        assert families[row.name].type == row.kind, row.name
        for sample in families[row.name].samples:
            assert sample.labels["model_name"] == SERVED and sample.labels["engine"] == "0"
