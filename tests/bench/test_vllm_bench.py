"""`bench vllm`'s pieces that need no vLLM: server flags, prompts, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_helpers import ScriptedServer
from service_process import ServiceProcess

from asynchicache.bench.processes.peers import vllm
from asynchicache.bench.processes.vllm_process import (
    VllmFlags,
    VllmThreads,
    machine_cores,
    metric_sum,
)
from asynchicache.bench.vllm import (
    ARMS,
    DECODE_ARMS,
    BenchConfig,
    _arms,
    _report,
    _service_gone,
    messages,
)
from asynchicache.bench.vllm_decode import DecodeLoad, decode_tok_s
from asynchicache.storage.client.storage_client import StorageClient


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


def test_the_decode_arm_is_8_clients_of_256_tokens_by_default() -> None:
    assert BenchConfig(None).decode == DecodeLoad(8, 256)
    prompts = DecodeLoad().prompts(3)
    assert len(prompts) == 8 and len({p[0]["content"] for p in prompts}) == 8
    assert prompts == DecodeLoad().prompts(3) and prompts != DecodeLoad().prompts(4)


def test_decode_clients_run_together_and_the_rate_counts_every_token(
    scripted_server: ScriptedServer,
) -> None:
    scripted_server.tokens = 5
    load = DecodeLoad(clients=4, max_tokens=5)
    rate = decode_tok_s(scripted_server.url, load, seed=1)
    calls = scripted_server.calls
    assert len(calls) == 4
    assert {c.body["max_tokens"] for c in calls} == {5}
    assert all(c.body["ignore_eos"] and c.body["temperature"] == 0 for c in calls)
    # At once: every request arrived before the first one finished.
    assert max(c.received for c in calls) < min(c.finished for c in calls)
    wall = max(c.finished for c in calls) - min(c.received for c in calls)
    assert 0 < rate <= 4 * 5 / wall


def test_report_has_the_decode_rates_and_the_connector_cost() -> None:
    times = {arm: [1.0] for arm in ARMS}
    rates = {"vllm_decode": [100.0, 90.0, 110.0], "ours_decode": [96.0, 95.0, 99.0]}
    out = _report(BenchConfig(None), times, {}, 0.0, rates)
    assert (out["vllm_decode_tok_s"], out["ours_decode_tok_s"]) == (100.0, 96.0)
    assert out["ours_decode_cost"] == 0.04
    assert set(out["decode_rounds"]) == set(DECODE_ARMS)
    assert out["decode_load"] == {"clients": 8, "max_tokens": 256, "prompt_tokens": 64}
    no_decode = _report(BenchConfig(None, decode=None), times, {}, 0.0, {})
    assert "ours_decode_cost" not in no_decode


def test_a_restart_arm_waits_for_its_cache_service_to_exit(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/svc.sock"
    svc = ServiceProcess(tmp_path / "kv", address).start()
    try:
        probe = StorageClient.connect(address)
        assert probe.wait_ready(30)
        probe.close()
        assert not _service_gone(address, 1.0)  # it answers
    finally:
        svc.stop()
    assert _service_gone(address, 10.0)


def test_dtype_auto_reaches_every_arm() -> None:
    """`--dtype auto` on a bfloat16 checkpoint: every arm runs the checkpoint's dtype (on an
    AMX host, CPU_ATTN's amx kernel), not the float32 default."""
    arms = _arms(BenchConfig(None, dtype="auto"), Path("/m"), Path("/w"))
    for arm in arms.values():
        argv = arm.flags.argv()
        assert argv[argv.index("--dtype") + 1] == "auto"
