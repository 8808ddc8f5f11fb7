"""`bench pressure`: the workload, both clients against a scripted server, the figures,
and a real run of our two arms (vLLM's arms are the vLLM tests' to start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_helpers import ScriptedServer

from asynchicache.bench.clients.pressure_client import ClientRun, RequestTiming
from asynchicache.bench.pressure import ARMS, PressureOptions, arm_peer, main
from asynchicache.bench.reports.pressure_report import (
    by_class,
    figures,
    match_traces,
    percentile,
    request_rows,
)
from asynchicache.bench.workloads.pressure_workload import PressureParams, build, warm_up_prompt
from asynchicache.model.loader import default_model_path
from asynchicache.model.tokenizer import Tokenizer

TINY = PressureParams(l1_tokens=512, working_set=2.0, prefix_tokens=100, suffix_tokens=8,
                      repeats=2, max_tokens=2)  # fmt: skip


def test_the_workload_repeats_each_prefix_in_a_shuffled_order(tokenizer: Tokenizer) -> None:
    w = build(TINY, tokenizer)
    assert TINY.num_prefixes == 11  # ceil(2.0 x 512 / 100)
    assert len(w.requests) == 22 and w.working_set_tokens == 1100
    assert all(len(r.prompt) == 108 for r in w.requests)
    by_prefix: dict[int, set[tuple[int, ...]]] = {}
    for r in w.requests:
        by_prefix.setdefault(r.prefix, set()).add(r.prompt[:100])
    assert all(len(heads) == 1 for heads in by_prefix.values())  # one prefix each
    assert len({next(iter(h)) for h in by_prefix.values()}) == 11  # all different
    assert len({r.prompt for r in w.requests}) == 22  # every suffix its own
    assert [r.prefix for r in w.requests] != sorted(r.prefix for r in w.requests)  # shuffled
    assert build(TINY, tokenizer) == w  # the same prompts for every arm
    warm = warm_up_prompt(TINY, tokenizer)
    assert len(warm) == 108 and all(warm[:16] != r.prompt[:16] for r in w.requests)
    with pytest.raises(ValueError, match="repeats"):
        PressureParams(repeats=0)


def test_figures_use_nearest_rank_percentiles() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile(list(range(1, 101)), 0.99) == 99
    assert percentile([5.0], 0.99) == 5.0
    reqs = [RequestTiming(float(i), 0.1 * (i + 1), 1.0, 10, 2) for i in range(10)]
    reqs.append(RequestTiming(11.0, None, None, 10, 0, "boom"))
    f = figures(ClientRun("ours", 2.0, tuple(reqs)))
    assert f["requests"] == 11 and f["failed"] == 1 and f["req_s"] == 5.0
    assert f["output_tok_s"] == 10.0 and f["ttft_p50_s"] == 0.5 and f["ttft_p99_s"] == 1.0
    assert f["errors"] == ["boom"]


def test_traces_match_the_request_the_engine_took_in_its_window() -> None:
    reqs = [RequestTiming(10.0, 1.0, 2.0, 100, 2), RequestTiming(10.5, 0.2, 1.0, 100, 2)]
    traces = [{"arrived": 10.6, "prompt_tokens": 100}, {"arrived": 10.01, "prompt_tokens": 100}]
    matched = match_traces(reqs, traces)
    assert matched == [traces[1], traces[0]]
    assert match_traces([RequestTiming(10.0, 1.0, 2.0, 99, 2)], traces) == [None]


def test_prompts_of_one_length_sent_together_match_by_first_token() -> None:
    """A cold burst: two prompts of one length sent together, the second answered first.
    Each gets the trace whose first token it saw, not the one that arrived first."""
    first_sent, second_sent = (
        RequestTiming(0.0, 2.01, 3.0, 100, 2),
        RequestTiming(0.001, 1.0, 2.0, 100, 2),
    )
    traces = [
        {"arrived": 0.002, "prompt_tokens": 100, "first_token": 0.995},
        {"arrived": 0.003, "prompt_tokens": 100, "first_token": 2.0},
    ]
    assert match_traces([first_sent, second_sent], traces) == [traces[1], traces[0]]


def test_every_request_gets_its_trace_and_its_class() -> None:
    """First asks of a prefix (misses) and later asks apart; a traced request whose prefix
    came from the cache counts as fully cached, whichever ask it was."""
    reqs = [RequestTiming(0.0, 1.0, 2.0, 108, 2), RequestTiming(0.1, 0.3, 1.0, 108, 2),
            RequestTiming(0.2, 0.2, 1.0, 109, 2)]  # fmt: skip
    trace = {"steps": 1, "max_step_tokens": 8, "computed_tokens": 8, "queue_s": 0.01,
             "load_s": 0.02, "load_ticket_s": 0.005, "wait_s": 0.0, "step_s": 0.1,
             "overhead_s": 0.01, "max_step_s": 0.1, "load_host_pages": 6}  # fmt: skip
    traces = [
        {**trace, "arrived": 0.01, "prompt_tokens": 108, "first_token": 0.99, "cached": {}},
        {**trace, "arrived": 0.11, "prompt_tokens": 108, "first_token": 0.39,
         "cached": {"host": 96}},
    ]  # fmt: skip
    rows = request_rows(ClientRun("ours", 2.0, tuple(reqs)), traces, [0, 0, 1])
    assert [r["first_ask"] for r in rows] == [True, False, True]
    assert rows[1]["http_in_s"] == pytest.approx(0.01) and rows[1]["load_ticket_s"] == 0.005
    assert rows[1]["http_out_s"] == pytest.approx(0.01) and rows[1]["cached"] == {"host": 96}
    assert rows[1]["load_pages"] == {"host": 6, "storage": 0}
    assert "http_in_s" not in rows[2]  # no trace fits it
    classes = by_class(rows, prefix_tokens=100)
    assert classes["first_ask"] == {"requests": 2, "ttft_p50_s": 0.2, "ttft_p90_s": 1.0,
                                    "ttft_p99_s": 1.0}  # fmt: skip
    assert classes["repeat"]["requests"] == 1 and classes["repeat"]["ttft_p90_s"] == 0.3
    assert classes["fully_cached"]["requests"] == 1  # 96 of 100 prefix tokens cached
    untraced = request_rows(ClientRun("vllm", 2.0, tuple(reqs)), [], [0, 0, 1])
    assert set(by_class(untraced, prefix_tokens=100)) == {"first_ask", "repeat"}


def test_arms_compute_on_stated_threads(tmp_path: Path) -> None:
    model = default_model_path()
    opts = PressureOptions(tmp_path, model, TINY, threads=1)
    cmd = arm_peer(opts, "ours-l1").command(model, tmp_path)
    assert cmd[cmd.index("--threads") + 1] == "1" and "--no-host-cache" in cmd
    default = arm_peer(PressureOptions(tmp_path, model, TINY), "ours").command(model, tmp_path)
    assert "--threads" not in default  # by default our server keeps its own thread policy
    assert cmd[cmd.index("--device-cache-tokens") + 1] == "512"
    with pytest.raises(ValueError, match="arms"):
        PressureOptions(tmp_path, model, TINY, arms=("nope",))
    assert set(ARMS) == {"ours", "ours-l1", "vllm", "vllm-ours"}


def _prompts_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([[1, 2, 3, i] for i in range(n)]))
    return path


def _client(python: str, url: str, tmp_path: Path, client: str) -> ClientRun:
    out = tmp_path / f"{client}.json"
    argv = [python, "-m", "asynchicache.bench.clients.pressure_client", "--requests",
            str(_prompts_file(tmp_path, 6)), "--url", url, "--concurrency", "2",
            "--max-tokens", "3", "--client", client, "--out", str(out)]  # fmt: skip
    subprocess.run(argv, check=True, timeout=600, env={**os.environ, "PYTHONPATH": os.getcwd()})
    return ClientRun.from_json(json.loads(out.read_text()))


def test_our_client_times_every_request(tmp_path: Path) -> None:
    """(vLLM's client, the default, is tested under vLLM: tests/vllm/test_pressure_client.py.)"""
    server = ScriptedServer(first_delay_s=0.2, gap_s=0.05, tokens=3)
    server.start()
    try:
        run = _client(sys.executable, server.url, tmp_path, "ours")
    finally:
        server.close()
    assert run.client == "ours" and len(run.requests) == 6
    for r in run.requests:
        assert r.ok and r.prompt_tokens == 4 and r.output_tokens == 3
        assert 0.2 <= r.ttft < 1.5 and r.latency >= r.ttft + 0.09
    bodies = [c.body for c in server.calls]
    assert sorted(b["prompt"][-1] for b in bodies) == list(range(6))
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0.0 for b in bodies)
    # Two in flight at most: six requests of >= 0.3 s each take three rounds.
    assert run.duration_s >= 0.85


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pressure_runs_our_arms_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sigterm_kept: None
) -> None:
    out = tmp_path / "p"
    argv = ["--out", str(out), "--model", str(default_model_path()), "--arms", "ours,ours-l1",
            "--client", "ours", "--clients", "2", "--l1-tokens", "512", "--working-set", "2",
            "--prefix-tokens", "100", "--suffix-tokens", "8", "--repeats", "2",
            "--max-tokens", "2", "--work-dir", str(tmp_path), "--json"]  # fmt: skip
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    record = json.loads((out / "pressure.json").read_text())
    assert printed == record and record["failed"] == {}
    assert record["workload"]["requests"] == 22
    ours, l1 = record["results"]["2"]["ours"], record["results"]["2"]["ours-l1"]
    for r in (ours, l1):
        f = r["figures"]
        assert f["requests"] == 22 and f["failed"] == 0 and f["req_s"] > 0
        assert 0 < f["ttft_p50_s"] <= f["ttft_p90_s"] <= f["ttft_p99_s"] <= f["ttft_max_s"]
        assert r["engine_phases"]["requests"] == 24  # the run and the two warm-ups
        slow = r["slowest"][0]
        assert slow["ttft_s"] == f["ttft_max_s"] and slow["steps"] >= 1  # traced
        # Every request, each with its trace (the engine kept them all).
        assert len(r["requests"]) == 22 and all("http_in_s" in q for q in r["requests"])
        assert r["by_class"]["first_ask"]["requests"] == 11
        assert 0 < r["computed_token_ratio"] <= 1
    assert ours["by_class"]["fully_cached"]["requests"] >= 1
    # Every repeat of a prefix hits with the host tier: less computed than L1 alone.
    assert ours["computed_token_ratio"] < l1["computed_token_ratio"]
    assert set(record["ratios"]["2"]) >= {
        "ours/ours-l1:req_s",
        "ours/ours-l1:ttft_p99_s",
        "ours/ours-l1:repeat_ttft_p90_s",
    }
    assert record["settings"]["vllm_threads"]["threads"] >= 1
    assert (out / "pressure_ttft_cdf.png").stat().st_size > 10_000
    assert not list(tmp_path.glob("asynchicache-pressure-*"))  # disk folders removed
