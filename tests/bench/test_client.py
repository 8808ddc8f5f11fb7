"""The streaming client against a scripted server on a real socket."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from bench_helpers import ScriptedServer

from asynchicache.bench.clients.client import ClientConfig, main, run_workload
from asynchicache.bench.workloads.workloads import RequestSpec, Session, Workload, make_workload


def _cfg(server: ScriptedServer, **kw: object) -> ClientConfig:
    return ClientConfig(server.url, progress=False, **kw)


def _turn(body: dict) -> int:
    return sum(1 for m in body["messages"] if m["role"] == "assistant")


def test_multiturn_waits_for_answers_and_times_tokens(scripted_server: ScriptedServer) -> None:
    w = make_workload(
        "multiturn",
        seed=0,
        scale=0.1,
        assignments=["users=2", "rounds=3", "rate=100", "max_tokens=3"],
    )
    run = run_workload(w, _cfg(scripted_server, cache_salt="tenant"))
    assert [r.error for r in run.results] == [None] * 6
    turns = sorted(_turn(c.body) for c in scripted_server.calls)
    assert turns == [0, 0, 1, 1, 2, 2]
    # Each session's turn r went out only after its turn r-1 had finished, and carries it.
    by_session: dict[str, list] = {}
    for c in scripted_server.calls:
        by_session.setdefault(c.body["messages"][1]["content"], []).append(c)
    assert sorted(len(v) for v in by_session.values()) == [3, 3]
    for session_calls in by_session.values():
        session_calls.sort(key=lambda c: c.received)
        for prev, nxt in itertools.pairwise(session_calls):
            assert nxt.received >= prev.finished
            turn = _turn(prev.body)
            assert nxt.body["messages"][-2] == {
                "role": "assistant",
                "content": f" t{turn}.0 t{turn}.1 t{turn}.2",
            }
    body = scripted_server.calls[0].body
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] and body["max_tokens"] == 3 and body["temperature"] == 0
    assert body["cache_salt"] == "tenant"
    for r in run.results:
        assert r.ttft_s is not None and r.ttft_s >= 0.05  # the scripted first-token delay
        # Gaps between arrivals are not bounded below by the server's 10 ms pauses
        # (a late first chunk shortens the next gap), so check only their consistency.
        assert len(r.itl_s) == 2 and all(g >= 0 for g in r.itl_s)
        assert r.e2e_s is not None and r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
        assert r.cached_tokens == 16 * r.turn
        tier = "device" if r.turn % 2 == 0 else "disk"
        assert r.cached_by_tier[tier] == 16 * r.turn
        assert r.answer == f" t{r.turn}.0 t{r.turn}.1 t{r.turn}.2"


def _manual(questions: tuple[str, ...], chat: bool) -> Workload:
    session = Session("be brief", "", questions, chat=chat)
    specs = tuple(RequestSpec(0, t, 0.0) for t in range(len(questions)))
    return Workload("manual", (session,), specs, 3, {})


def test_a_failed_turn_is_recorded_and_its_successors_are_not_sent(
    scripted_server: ScriptedServer,
) -> None:
    run = run_workload(_manual(("hello", "please FAIL", "after"), chat=True), _cfg(scripted_server))
    ok, failed, skipped = run.results
    assert ok.ok and ok.ttft_s is not None
    assert failed.error is not None and "HTTP 500" in failed.error and not failed.ok
    assert skipped.error == "an earlier turn of this chat failed"
    assert len(scripted_server.calls) == 2  # the third was never sent


def test_max_concurrency_one_serialises_requests(scripted_server: ScriptedServer) -> None:
    run = run_workload(
        _manual(("a", "b", "c", "d"), chat=False), _cfg(scripted_server, max_concurrency=1)
    )
    assert all(r.ok for r in run.results)
    calls = sorted(scripted_server.calls, key=lambda c: c.received)
    for prev, nxt in itertools.pairwise(calls):
        assert nxt.received >= prev.finished


def test_bench_serve_writes_results_and_summary(
    scripted_server: ScriptedServer, tmp_path: Path
) -> None:
    code = main(
        [
            "--url",
            scripted_server.url,
            "--workload",
            "sysprompt",
            "--scale",
            "0.05",
            "--set",
            "requests=5",
            "--set",
            "rate=50",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert code == 0
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 5 and all(json.loads(x)["error"] is None for x in lines)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] == 5 and summary["errors"] == 0
    assert summary["ttft"]["p90"] >= summary["ttft"]["p50"] > 0
    assert summary["ideal"]["prompt_tokens"] > 0 and 0 < summary["ideal"]["hit_rate"] < 1
