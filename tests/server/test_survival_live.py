"""The server outlives its engine, and stops gracefully (issue 22, findings 1 and 5).

One live `asynchicache serve` with a disk tier, used by both tests in order:

* the engine is killed (-9) while a stream and a non-streaming request run: the
  stream ends with an error event and `[DONE]`, the other with a JSON 503;
  `/ready` answers 503 until a new engine is up; then the same cache service
  serves the same greedy tokens (from disk: L1 and L2 went with the engine).
  On 388548a the server shut down ("engine died; shutting down").
* SIGTERM while requests run, with `--shutdown-timeout 8`: a short stream that
  was running finishes normally, a long stream ends with an error event and
  `[DONE]`, a long non-streaming request gets a JSON 503, nothing new is taken,
  the engine stops on its SIGTERM (no SIGKILL) and the server exits 0. On
  388548a the streams were cut without an error event or `[DONE]`, the other
  request got a plain-text 500, and the engine "ignored SIGTERM for 15 s".
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import LiveServer
from processes import pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHUTDOWN_TIMEOUT_S = 8
PROMPT = "The history of the lighthouse on the northern cape begins"
# Several pages long, so that its pages reach the disk tier before the engine is killed.
CACHED_PROMPT = " ".join(
    f"Entry {i}: the keeper noted the wind, the ships and the colour of the sea." for i in range(6)
)
LONG = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("survival")
    timeout = ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    srv = LiveServer(root / "kv", root / "server.log", *timeout).start()
    try:
        yield srv
    finally:
        srv.shutdown()


class Call(threading.Thread):
    """One POST in a thread: its status, body, and (streams) the SSE payloads as they come."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.status: int | None = None
        self.text = ""
        self.events: list[str] = []
        self.content_type = ""
        self.first = threading.Event()  # the first SSE payload (or the answer) arrived
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=300) as r:
                self.status = r.status_code
                self.content_type = r.headers.get("content-type", "")
                for line in r.iter_lines():
                    self.text += line + "\n"
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.first.set()

    def result(self, timeout: float = 120) -> Call:
        self.join(timeout)
        assert not self.is_alive(), f"{self.body} still running"
        return self

    def payloads(self) -> list[Any]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


def _assert_stream_ended_with_error(call: Call, code: str) -> None:
    assert call.error is None, call.error
    assert call.status == 200 and call.events, call.text[-500:]
    assert call.events[-1] == "[DONE]", call.events[-3:]
    last = json.loads(call.events[-2])
    assert last["error"]["code"] == code, last
    assert "choices" in call.payloads()[0]  # it had been streaming tokens


def _assert_json_503(call: Call) -> None:
    assert call.error is None, call.error
    assert call.status == 503, (call.status, call.text[:300])
    assert call.content_type.startswith("application/json")
    assert set(json.loads(call.text)["error"]) == {"message", "type", "param", "code"}


def _ready(server: LiveServer) -> int:
    return httpx.get(server.url + "/ready", timeout=30).status_code


def _greedy(server: LiveServer) -> tuple[list[str], dict[str, int]]:
    """The greedy tokens of CACHED_PROMPT, and where its cached prompt tokens came from."""
    body = {"prompt": CACHED_PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    answer = r.json()
    tiers = answer["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
    return answer["choices"][0]["logprobs"]["tokens"], tiers


def _disk_pages(server: LiveServer) -> int:
    return int(server.stats()["storage"]["disk"]["pages"])


def _started(call: Call, timeout: float = 120) -> None:
    assert call.first.wait(timeout) and call.error is None, call.error


def test_the_engine_is_restarted_and_requests_in_flight_get_json_errors(
    server: LiveServer,
) -> None:
    before, _ = _greedy(server)
    deadline = time.monotonic() + 60
    while _disk_pages(server) == 0:  # stores wait for a quiet engine (at most ~1 s)
        assert time.monotonic() < deadline, "no page reached the disk tier"
        time.sleep(0.2)
    pids = server.pids()
    url = server.url + "/v1/completions"
    stream = Call(url, {**LONG, "stream": True})
    whole = Call(url, LONG)
    _started(stream)
    time.sleep(0.5)  # the non-streaming one is in the engine too
    os.kill(pids["engine"], signal.SIGKILL)
    _assert_stream_ended_with_error(stream.result(), "engine_unavailable")
    _assert_json_503(whole.result())
    assert _ready(server) == 503  # the new engine is still loading its model
    new_engine = server.wait_role("engine", not_pid=pids["engine"])
    deadline = time.monotonic() + 300
    while _ready(server) != 200:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.5)
    after = server.pids()
    assert after == {"engine": new_engine, "cache-service": pids["cache-service"]}
    assert pid_alive(server.pid)
    after_tokens, tiers = _greedy(server)
    assert after_tokens == before  # the same tokens...
    assert tiers["disk"] > 0 and tiers["device"] == tiers["host"] == 0, tiers  # ...from L3


def test_sigterm_finishes_what_it_can_and_ends_the_rest_with_errors(server: LiveServer) -> None:
    url = server.url + "/v1/completions"
    engine = server.pids()["engine"]
    long_stream = Call(url, {**LONG, "stream": True})
    long_whole = Call(url, LONG)
    _started(long_stream)
    short = Call(url, {"prompt": "Hello", "max_tokens": 4, "stream": True, "temperature": 0})
    _started(short)
    time.sleep(0.2)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    time.sleep(0.5)
    with pytest.raises(httpx.ConnectError):  # no longer listening
        httpx.post(url, json={"prompt": "Hi", "max_tokens": 1}, timeout=10)
    short.result()
    assert short.error is None and short.events[-1] == "[DONE]", short.text[-500:]
    assert [p["choices"][0]["finish_reason"] for p in short.payloads()][-1] == "length"
    _assert_stream_ended_with_error(long_stream.result(), "engine_unavailable")
    _assert_json_503(long_whole.result())
    code = server.proc.wait(120)  # type: ignore[union-attr]
    took = time.monotonic() - start
    assert code == 0
    assert not pid_alive(engine)
    log = Path(server.log_path).read_text(errors="replace")
    assert "ignored SIGTERM" not in log and "engine stopped (exit code 0)" in log, log[-3000:]
    assert took < SHUTDOWN_TIMEOUT_S + 2 * 15, took  # the drain, then each child's stop
