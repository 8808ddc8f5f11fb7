"""`asynchicache bench compare`: peers' commands, medians and ratios, and a real run of our
server against a peer (vLLM itself is not needed to test the machinery: the peer is the
scripted OpenAI server of bench_helpers, run as its own process like any `--peer-cmd`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from asynchicache.bench.compare import _order, _Round, main, medians, ratios
from asynchicache.bench.compare_phases import clients_workload
from asynchicache.bench.processes.peers import Peer, ours, parse_peer, vllm
from asynchicache.model.loader import default_model_path


def test_peer_commands_fill_their_placeholders() -> None:
    peer = parse_peer("other=srv --port {port} --model {model} --name {name} --dir '{disk}/x y'")
    assert peer.name == "other"
    cmd = peer.command(Path("/m"), Path("/d"))
    assert cmd == [
        "srv",
        "--port",
        "{port}",
        "--model",
        "/m",
        "--name",
        "smollm2",
        "--dir",
        "/d/x y",
    ]  # {port} is the launcher's to fill
    assert "{model}" in peer.shell()  # the recorded command is the template
    with pytest.raises(ValueError, match="port"):
        parse_peer("x=srv --model {model}")
    with pytest.raises(ValueError, match="NAME=COMMAND"):
        parse_peer("no-command")
    with pytest.raises(ValueError):
        Peer("", ("srv", "{port}"))


def test_the_vllm_command_is_the_recorded_one() -> None:
    cmd = vllm(Path("/v/bin/python"), 123, ["--max-num-seqs", "64"]).command(Path("/m"), Path("/d"))
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in (
        "--enable-prefix-caching",
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        "123",
        "--max-num-seqs",
    ):
        assert flag in cmd
    assert "--disk-cache-dir" in ours().command(Path("/m"), Path("/d"))


def test_medians_ratios_and_rotating_order() -> None:
    rounds = [
        _Round(0, {"a": {"t_s": 1.0, "x_tok_s": 10.0}, "b": {"t_s": 2.0, "x_tok_s": 5.0}}),
        _Round(1, {"a": {"t_s": 3.0, "x_tok_s": 30.0}, "b": {"t_s": 4.0}}),
        _Round(2, {"a": {"t_s": 2.0, "x_tok_s": 20.0}, "b": {"t_s": 8.0, "x_tok_s": 5.0}}),
    ]
    med = medians(rounds, ["a", "b"])
    assert med == {"a": {"t_s": 2.0, "x_tok_s": 20.0}, "b": {"t_s": 4.0, "x_tok_s": 5.0}}
    assert ratios(med, "a") == {"b": {"t_s": 0.5, "x_tok_s": 4.0}}
    peers = [ours(), parse_peer("b=s {port}"), parse_peer("c=s {port}")]
    firsts = [_order(peers, r)[0].name for r in range(3)]
    assert firsts == ["ours", "b", "c"]


def test_clients_workload_is_single_turn_and_all_due_at_once() -> None:
    w = clients_workload(4, 3, 64, seed=7)
    assert len(w.requests) == 12 and {r.arrival_s for r in w.requests} == {0.0}
    assert not any(w.waits_for_previous(r) for r in w.requests)
    assert len({s.system for s in w.sessions}) == 1  # one shared system prompt
    assert len({s.questions for s in w.sessions}) == 12  # distinct questions
    assert clients_workload(4, 3, 64, seed=7) == w  # the same prompts for every server


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compare_our_server_and_a_peer_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sigterm_kept: None
) -> None:
    out = tmp_path / "cmp"
    # A second server of ours would add two start-ups (~17 s) and prove nothing more: the
    # peer machinery ({port}/{model}/{name}/{disk}, readiness, restart, CPU by process) is
    # the same for any command, and ours is the one whose figures are checked below.
    script = Path(__file__).with_name("bench_helpers.py")
    peer = (
        f"scripted={sys.executable} {script} --port {{port}} --model {{model}}"
        " --served-model-name {name} --disk {disk} --tokens 3"
    )
    argv = [
        "--out",
        str(out),
        "--model",
        str(default_model_path()),
        "--no-vllm",
        "--peer-cmd",
        peer,
        "--rounds",
        "1",  # the rotation and the medians over rounds are unit-tested above
        "--clients",
        "2",
        "--requests-per-client",
        "1",
        "--max-tokens",
        "3",
        "--cold-prompt-tokens",
        "120",
        "--work-dir",
        str(tmp_path),
    ]
    # In this process (the `python -m asynchicache bench` dispatch is test_output_flags'):
    # one interpreter start and import fewer (`sigterm_kept`: main's SIGTERM handler goes).
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    record = json.loads((out / "compare.json").read_text())
    assert printed["median"] == record["median"] and record["failed"] == {}
    assert set(record["commands"]) == {"ours", "scripted"}
    keys = {
        "startup_s",
        "ttft_cold_s",
        "ttft_warm_s",
        "ttft_restart_s",
        "c2_tok_s",
        "c2_mean_ttft_s",
        "c2_p50_ttft_s",
        "c2_p99_ttft_s",
    }
    for name in ("ours", "scripted"):
        assert set(record["median"][name]) == keys
        assert all(v > 0 for v in record["median"][name].values())
    assert set(record["ratios"]["scripted"]) == keys
    assert [list(r["figures"]) for r in record["rounds"]] == [["ours", "scripted"]]
    details = record["rounds"][0]["details"]["ours"]
    # The same prompt after the restart came from our disk tier.
    assert details["long_prompt"]["cached_restart"] >= 96
    assert details["c2"]["completion_tokens"] == 6 and details["c2"]["errors"] == 0
    assert details["c2"]["cpu_s_by_process"]["engine"] > 0
    peer = record["rounds"][0]["details"]["scripted"]["c2"]
    assert peer["completion_tokens"] == 6 and peer["errors"] == 0
    assert not list(tmp_path.glob("asynchicache-compare-*"))  # disk folders removed
