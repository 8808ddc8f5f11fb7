"""`bench vllm`'s pieces that need no vLLM: server flags, prompts, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asynchicache.bench.peers import vllm
from asynchicache.bench.vllm import ARMS, BenchConfig, _arms, _report, messages
from asynchicache.bench.vllm_process import VllmFlags, VllmThreads, machine_cores, metric_sum


def _argv(connector: str | None = None, extra_config: dict[str, str] | None = None) -> list[str]:
    """One arm's vLLM command line; every arm is given the same model and extra flags."""
    extra = ("--block-size", "32")
    return VllmFlags(
        Path("/m"), connector=connector, extra_config=extra_config or {}, extra=extra
    ).argv()


def test_every_arm_gets_the_same_vllm_flags_and_only_its_connector() -> None:
    plain = _argv()
    ours = _argv("AsynchicacheConnector", {"disk_cache_dir": "/d"})
    example = _argv("ExampleConnector", {"shared_storage_path": "/s"})
    cut = ours.index("--kv-transfer-config")
    assert ours[:cut] + ours[cut + 2 :] == plain
    config = json.loads(ours[cut + 1])
    assert config["kv_connector_module_path"] == "asynchicache.integrations.vllm"
    assert config["kv_connector_extra_config"] == {"disk_cache_dir": "/d"}
    assert "--enforce-eager" in plain
    assert "kv_connector_module_path" not in json.loads(
        example[example.index("--kv-transfer-config") + 1]
    )


def test_prompts_are_long_distinct_and_reproducible() -> None:
    a, b = messages(1, 1500), messages(2, 1500)
    assert a == messages(1, 1500) and a != b
    assert len(a[0]["content"].split()) > 900


def test_report_has_the_medians_and_ratios_the_issue_names() -> None:
    times = {arm: [3.0, 1.0, 2.0] for arm in ARMS}
    times["ours_restart"] = [0.2, 0.1, 0.3]
    out = _report(BenchConfig(None), times, {arm: [0.0] for arm in ARMS}, 0.5)
    assert out["vllm_cold_ttft_s"] == 2.0 and out["ours_restart_ttft_s"] == 0.2
    assert out["ours_restart_vs_vllm_cold"] == 0.1
    assert {f"{arm}_ttft_s" for arm in ARMS} <= out.keys()


def test_metric_sum_matches_labels() -> None:
    metrics = {
        'x_total{engine="0",tier="disk"}': 3.0,
        'x_total{engine="0",tier="host"}': 2.0,
        'y_total{engine="0"}': 7.0,
    }
    assert metric_sum(metrics, "x_total") == 5.0
    assert metric_sum(metrics, "x_total", tier="disk") == 3.0
    assert metric_sum(metrics, "y_total") == 7.0


def test_every_arm_computes_on_the_same_threads() -> None:
    # vLLM reserves one more core when a connector is set; on 2 cores that
    # gives the connector arms two model threads and vLLM alone one, which
    # measured our cold arm 2x faster than vLLM alone (2.28 s vs 4.51 s).
    cores = machine_cores()
    arms = _arms(BenchConfig(None, threads=1), Path("/m"), Path("/w"))
    assert {name: arm.env for name, arm in arms.items()} == {
        name: {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(cores - 1)}
        for name in ("vllm", "ours", "example")
    }
    report = _report(BenchConfig(None), {a: [1.0] for a in ARMS}, {}, 0.0)
    assert report["env"] == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}  # default: every core
    assert report["vllm_threads"]["threads"] == cores
    with pytest.raises(ValueError, match="threads"):
        BenchConfig(None, threads=cores + 1)


def test_vllm_threads_set_the_reservation() -> None:
    assert VllmThreads.of(2, cores=2).env() == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert VllmThreads.of(1, cores=2).env() == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert VllmThreads.of(cores=4).describe() == {
        "threads": 4,
        "cores": 4,
        "VLLM_CPU_NUM_OF_RESERVED_CPU": 0,
    }
    with pytest.raises(ValueError):
        VllmThreads.of(0, cores=2)
    peer = vllm(Path("/p"), 1, threads=VllmThreads.of(1, cores=2))
    assert peer.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"  # bench compare's vLLM too
