"""Issue 39, finding 13: a hung engine is noticed, and every request has a deadline.

On 9f7c8b6 a stopped engine (SIGSTOP, or a step that deadlocks) was never noticed:
its requests waited forever and the server never restarted it. Now:

* the watchdog pings the engine (answered between two steps); silent past
  `--engine-step-timeout` it is killed and restarted with back-off: its requests
  in flight end with a JSON error event, `/ready` answers 503 with the reason
  while the new engine loads, then 200, and the same greedy request gives the same
  answer;
* a generation runs at most `--request-timeout` from its start: then it is aborted,
  answered 504 (`request_timeout`; an error event on a stream), and the engine,
  which was only slow, is left alone.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from host_speed import scaled
from live_server import LiveServer
from settling import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Set on the reference host, scaled to this one (tests/support/host_speed.py).
STEP_TIMEOUT_S = round(scaled(5.0), 1)
REQUEST_TIMEOUT_S = round(scaled(8.0), 1)  # a short request meets it even when loaded
NOTICED_S = scaled(60.0)  # bound on noticing (timeout + the watch's turn + a machine's lag)
RESTART_S = scaled(300.0)  # a new engine loads the model and answers
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
LONG = {"prompt": "Count: one, two, three,", "max_tokens": 2000, "temperature": 0,
        "ignore_eos": True, "stream": True}  # fmt: skip


def _stream_events(server: LiveServer, first: threading.Event, out: list[dict]) -> None:
    """POST the LONG stream; every data event into `out` (set `first` at the first)."""
    with (
        httpx.Client(base_url=server.url, timeout=RESTART_S) as client,
        client.stream("POST", "/v1/completions", json=LONG) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                first.set()
    first.set()


def _completes(server: LiveServer) -> bool:
    r = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=scaled(60))
    return r.status_code == 200


def _ready(server: LiveServer) -> tuple[int, dict]:
    r = httpx.get(server.url + "/ready", timeout=scaled(30))
    return r.status_code, r.json()


def test_a_hung_engine_is_killed_and_restarted(tmp_path: Path) -> None:
    server = LiveServer(None, tmp_path / "server.log", "--engine-step-timeout",
                        str(STEP_TIMEOUT_S)).start()  # fmt: skip
    try:
        before = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=scaled(120)).json()
        first, events = threading.Event(), []
        stream = threading.Thread(target=_stream_events, args=(server, first, events))
        stream.start()
        assert first.wait(scaled(120)), server.log_tail()
        hung = server.pids()["engine"]
        os.kill(hung, signal.SIGSTOP)
        t0 = time.monotonic()
        stream.join(NOTICED_S)
        noticed_s = time.monotonic() - t0
        assert not stream.is_alive(), f"the stream still runs:\n{server.log_tail()}"
        errors = [e["error"] for e in events if "error" in e]
        assert len(errors) == 1 and "--engine-step-timeout" in errors[0]["message"], events[-3:]
        # Silence counts from the last answer, up to a ping's turn (0.5 s) before the stop.
        assert STEP_TIMEOUT_S - 1.0 <= noticed_s < NOTICED_S
        status, body = _ready(server)  # the new engine is still loading (or just answered)
        if status != 200:
            assert status == 503 and "--engine-step-timeout" in body["reason"], body
            assert "engine" in body["checks"] and body["status"] == "unavailable", body
        new = server.wait_role("engine", hung, RESTART_S)
        wait_until(lambda: _ready(server)[0] == 200, "/ready 200", RESTART_S, every_s=0.5)
        after = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=scaled(120)).json()
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert new != hung and server.proc is not None and server.proc.poll() is None
        assert "alive but silent" in server.log_tail(20_000)
    finally:
        server.shutdown()


def test_a_request_past_its_deadline_is_aborted_and_the_engine_left_alone(
    tmp_path: Path,
) -> None:
    server = LiveServer(None, tmp_path / "server.log", "--request-timeout",
                        str(REQUEST_TIMEOUT_S)).start()  # fmt: skip
    try:
        engine = server.pids()["engine"]
        os.kill(engine, signal.SIGSTOP)  # slow, not hung: well within the step timeout
        try:
            # The plain request and the stream side by side: each meets its own deadline
            # (one after the other they waited it out twice).
            first, events = threading.Event(), []
            stream = threading.Thread(target=_stream_events, args=(server, first, events))
            stream.start()
            t0 = time.monotonic()
            r = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=scaled(60))
            waited = time.monotonic() - t0
            stream.join(scaled(60))
            assert not stream.is_alive(), f"the stream still runs:\n{server.log_tail()}"
        finally:
            os.kill(engine, signal.SIGCONT)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "request_timeout"
        assert REQUEST_TIMEOUT_S <= waited < REQUEST_TIMEOUT_S + scaled(30)
        assert [e["error"]["code"] for e in events if "error" in e] == ["request_timeout"]
        # The engine ran on (no restart) and dropped the aborted requests.
        wait_until(lambda: _completes(server), "a completion within the deadline", 120)
        assert server.pids()["engine"] == engine
        wait_until(lambda: server.stats()["queues"]["running"] == 0, "no request running", 30)
    finally:
        server.shutdown()
