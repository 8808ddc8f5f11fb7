"""`bench fleet`: a real Valkey Cluster, real servers sharing L3 and L4, real vllm-router.

The end-to-end run is the smallest that still exercises every part (two instances, a
few sessions, one kv_aware arm with given credits); the numbers themselves are for a
quiet machine (docs/benchmarks.md gives the command)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from asynchicache.bench.fleet.fleet import (
    MEASURED,
    FleetOptions,
    build_workload,
    l1_per_instance,
    parse_credits,
    ratios,
    run,
    table,
)
from asynchicache.bench.fleet.fleet_router import Credits
from asynchicache.bench.processes.valkey_cluster import ValkeyCluster
from asynchicache.bench.workloads.ideal import replay


def test_valkey_cluster_spreads_keys_over_its_three_nodes_and_flushes(tmp_path: Path) -> None:
    import redis

    cluster = ValkeyCluster(tmp_path / "valkey").start()
    try:
        client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        try:
            for k in range(60):
                client.set(f"page{k}", b"x")
        finally:
            client.close()
        per_node = [int(cluster._call(p, "DBSIZE")) for p in cluster.ports]
        assert sum(per_node) == 60 and all(n > 0 for n in per_node), per_node
        cluster.flush()
        assert cluster.keys() == 0
    finally:
        procs = list(cluster.procs)
        cluster.stop()
    assert all(p.poll() is not None for p in procs)


def test_l1_is_sized_for_the_working_set_and_the_flags_are_checked(tmp_path: Path) -> None:
    opts = FleetOptions(out=tmp_path, sessions=60, working_set=3.0, instances=3)
    w = build_workload(opts)
    l1 = l1_per_instance(w, opts)
    ws = replay(w.ids, 16).working_set_tokens
    assert l1 % 16 == 0
    assert l1 >= 2 * max(len(p) for p in w.ids)  # a prompt always fits, with room
    if l1 > 2 * (max(len(p) for p in w.ids) + opts.max_tokens) + 16:
        assert 2.9 <= ws / (3 * l1) <= 3.0  # the aim, when the floor did not decide
    assert w.describe(l1, 3)["ideal_computed_tokens"] < w.describe(l1, 3)["prompt_tokens"]
    assert parse_credits("0.9,0.4,0.7") == Credits(0.9, 0.4, 0.7)
    for bad in ("0.9,0.4", "1.5,0.4,0.7"):
        with pytest.raises(ValueError):
            parse_credits(bad)
    with pytest.raises(ValueError, match="--arms"):
        FleetOptions(out=tmp_path, arms=("least_loaded",))
    figs = {"round_robin": {"figures": {"req_s": 1.0, "ttft_p90_s": 2.0}},
            MEASURED: {"figures": {"req_s": 1.5, "ttft_p90_s": 0.5}}}  # fmt: skip
    assert ratios(figs) == {f"{MEASURED}/round_robin:req_s": 1.5,
                            f"{MEASURED}/round_robin:ttft_p90_s": 0.25}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tiny_fleet_run_end_to_end(tmp_path: Path) -> None:
    """As users run it (no --credits): the credits are measured on the fleet and the
    router restarted with them; no router or server outlives the run."""
    opts = FleetOptions(out=tmp_path / "out", instances=2, clients=2, sessions=5,
                        max_tokens=2, arms=(MEASURED,), credit_words=16, credit_repeats=1,
                        work_dir=tmp_path)  # fmt: skip
    record = run(opts)
    assert record["failed"] == {}, record["failed"]
    r = record["results"][MEASURED]
    n = record["workload"]["requests"]
    assert r["figures"]["requests"] == n and r["figures"]["failed"] == 0
    assert sum(r["requests_per_instance"]) == n  # every request reached one instance
    measured = r["measured"]["credits"]
    assert r["credits"] == measured and set(measured) == {"host", "disk", "external"}
    argv = r["router_command"]
    assert argv[argv.index("--kv-penalty-disk") + 1] == f"{measured['disk']:.3f}"
    assert not _processes_started_from(tmp_path)  # the restarted router went too
    # The router priced requests by our events: the shared system page at least.
    assert r["router_credited_tokens"] > 0
    # No fleet computes less than the ideal (each reusable page once); later turns hit.
    assert r["computed_prompt_tokens"] >= 0.99 * record["workload"]["ideal_computed_tokens"]
    assert sum(r["cached_tokens_by_tier"].values()) > 0
    out = tmp_path / "out"
    assert json.loads((out / "fleet.json").read_text())["results"][MEASURED]
    assert (out / "fleet_ttft_cdf.png").stat().st_size > 0
    md = (out / "fleet.md").read_text()
    assert md == table(record) + "\n" and f"| {MEASURED} |" in md
    assert not list(tmp_path.glob("asynchicache-fleet-*"))  # the cluster's folder went


def _processes_started_from(folder: Path) -> list[str]:
    """Live processes that name `folder` in their command line or write their output
    under it (each server and router logs to its arm's folder)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            outputs = [os.readlink(proc / "fd" / fd) for fd in ("1", "2")]
        except OSError:
            continue
        if any(str(folder) in text for text in (cmd, *outputs)):
            found.append(cmd)
    return found
