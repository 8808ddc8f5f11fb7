"""What a sweep plans before it starts a server: options, tier sizes, server environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asynchicache.bench import sweep
from asynchicache.bench.sweep import SweepOptions, options_from_args, plan, thread_flags


def test_plan_sizes_l1_to_a_quarter_of_the_working_set(tmp_path: Path) -> None:
    opts = SweepOptions(
        "multiturn", tmp_path, scale=0.5, assignments=("users=24", "rounds=3", "max_tokens=8")
    )
    p = plan(opts)
    s = p["sizing"]
    assert p["requests"] == 72
    assert s["working_set_over_l1"] == pytest.approx(4.0, rel=0.02)
    assert s["host_cache_tokens"] == 2 * s["device_cache_tokens"]
    assert s["device_cache_tokens"] >= s["largest_request_tokens"]
    # No cap on running requests: the engine admits by memory.
    assert s["max_running_requests"] is None
    # Every prompt is re-sent with its history: far more prompt tokens than distinct ones.
    assert p["planned_prompt_tokens"] > 2 * s["working_set_tokens"]


def test_restart_plans_its_base_workload(tmp_path: Path) -> None:
    opts = SweepOptions(
        "restart", tmp_path, restart_of="sysprompt", scale=0.1, assignments=("requests=4",)
    )
    assert plan(opts)["workload"] == "sysprompt"
    with pytest.raises(ValueError, match="restart-of"):
        SweepOptions("restart", tmp_path, restart_of="restart")
    with pytest.raises(ValueError, match="unknown workload"):
        SweepOptions("nope", tmp_path)


def test_dry_run_cli_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = sweep.main(
        [
            "--workload",
            "longdoc",
            "--scale",
            "0.1",
            "--set",
            "docs=3",
            "--out",
            str(tmp_path),
            "--dry-run",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"] == "longdoc" and out["requests"] == 9
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_options_from_args_model_goes_to_the_server_too(tmp_path: Path) -> None:
    args = sweep._parser().parse_args([
        "--workload", "multiturn", "--out", str(tmp_path), "--model", "/m.gguf",
        "--setups", "l1, l1-l2-l3", "--server-arg=--chunked-prefill-size", "--server-arg=256",
        "--torch-threads", "3"])  # fmt: skip
    opts = options_from_args(args)
    assert opts.setups == ("l1", "l1-l2-l3") and opts.threads == 3
    assert opts.server_args == ("--chunked-prefill-size", "256", "--model", "/m.gguf")


def test_thread_flags_leave_the_default_to_the_server() -> None:
    assert thread_flags(3) == ["--threads", "3"]
    assert thread_flags(None) == []  # `serve` picks its own (engine.threads.ThreadGovernor)


def test_preemptions_per_request_flag_a_storm() -> None:
    assert sweep.preemption_rate(3, 100) == {
        "preemptions": 3,
        "preemptions_per_request": 0.03,
        "preemption_storm": False,
    }
    assert sweep.preemption_rate(6, 100)["preemption_storm"] is True
    assert sweep.preemption_rate(None, 100)["preemption_storm"] is None
