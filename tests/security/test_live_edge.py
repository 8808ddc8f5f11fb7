"""Issue 39's Must show, on a live `serve`: /health answers within 100 ms while a stream
with the longest stop list the edge takes, a 1,000,000-id /detokenize and a 2,000-request
burst run at once.

The server admits 4 work requests at once and queues 16 (`--max-concurrent-requests`,
`--max-waiting-requests`): the burst is mostly answered 429 with Retry-After, at once,
and the stream and the /detokenize (another client: another bearer token, the server
has no key) keep their place. On 9f7c8b6 every request of the burst was accepted, the
/detokenize decoded a million ids on the event loop (0.45 s) and each token of the
stream cost ~10 ms of it. The burst runs in a process of its own, so the probe does not
share its interpreter; like tests/security/test_live_limits.py, a busy machine's
scheduling delay may spoil a try, so the bound must hold in one of three, and it
follows the host's measured speed; on a shared machine a probe now and then waits for
the CPU whatever the server does (a loaded 2-core host showed single answers of 0.8 to
1.6 s, at a median of 10 to 14 ms), so 95% of the answers must be within the bound and
every one within twenty times it.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from health_probe import HEALTH_MS, HealthProbe
from host_speed import scaled
from live_server import LiveServer

from asynchicache.server.openai.schemas import MAX_STOP_CHARS, MAX_STOP_TOTAL_CHARS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent
BURST = 2000
AT_ONCE = 100  # connections of the burst open at a time
OTHER = {"Authorization": "Bearer another-client"}  # no key on this server: just a name


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("edge")
    srv = LiveServer(None, root / "server.log", "--max-concurrent-requests", "4",
                     "--max-waiting-requests", "16").start()  # fmt: skip
    try:
        yield srv
    finally:
        srv.shutdown()


def _stops() -> list[str]:
    """The longest stop list the edge takes, each stop a long partial match of the others."""
    body = ("ab" * MAX_STOP_CHARS)[: MAX_STOP_CHARS - 1] + "z"
    count = MAX_STOP_TOTAL_CHARS // MAX_STOP_CHARS
    return [chr(ord("c") + i) + body[:-1] for i in range(count - 1)] + [body]


def _stream(url: str, out: dict[str, object]) -> None:
    body = {"prompt": "List the numbers from one to fifty:", "max_tokens": 48,
            "ignore_eos": True, "stream": True, "stop": _stops()}  # fmt: skip
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=OTHER,
                      timeout=300) as r:  # fmt: skip
        out["status"] = r.status_code
        out["chunks"] = sum(1 for line in r.iter_lines() if line.startswith("data: {"))


# Built once: a million ids through json.dumps hold this process's GIL (and the probe).
MILLION_IDS = json.dumps({"tokens": [7] * 1_000_000}).encode()


def _detokenize(url: str, out: dict[str, object]) -> None:
    raw = MILLION_IDS
    r = httpx.post(url + "/detokenize", content=raw, timeout=60,
                   headers={**OTHER, "Content-Type": "application/json"})  # fmt: skip
    out["detokenize"] = (r.status_code, r.json()["error"]["code"])


def _burst(port: int) -> dict:
    body = json.dumps({"prompt": "Hi", "max_tokens": 1})
    argv = [sys.executable, str(HERE / "burst_client.py"), str(port), str(BURST), str(AT_ONCE)]
    done = subprocess.run([*argv, body], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _one_try(srv: LiveServer) -> list[float]:
    out: dict[str, object] = {}
    with HealthProbe(srv.url) as probe:
        stream = threading.Thread(target=_stream, args=(srv.url, out))
        stream.start()
        detokenize = threading.Thread(target=_detokenize, args=(srv.url, out))
        detokenize.start()
        burst = _burst(srv.port)
        detokenize.join(120)
        stream.join(300)
    statuses = {int(k): v for k, v in burst["statuses"].items()}
    assert sum(statuses.values()) == BURST and set(statuses) <= {200, 429}, burst
    assert statuses.get(429, 0) > BURST // 2 and burst["no_retry_after"] == 0, burst
    assert out["detokenize"] == (400, "context_length_exceeded"), out
    assert out["status"] == 200 and out["chunks"], out
    assert len(probe.latencies) >= 10
    return probe.latencies


def test_health_answers_while_the_edge_is_pushed(edge: LiveServer) -> None:
    """95% of the answers within 100 ms, and every one within two seconds, on the
    reference host; both follow the host's measured speed (tests/support/host_speed.py)."""
    bound_ms, worst_ms = scaled(HEALTH_MS), scaled(20 * HEALTH_MS)
    tries = []
    for _ in range(3):
        latencies = sorted(_one_try(edge))
        p95 = latencies[int(0.95 * (len(latencies) - 1))]
        tries.append((latencies[-1], p95, statistics.median(latencies), len(latencies)))
        if p95 < bound_ms and latencies[-1] < worst_ms:
            return
    raise AssertionError(
        f"/health slowest, p95 and median answers (ms), and probes, in each try (bounds "
        f"{bound_ms:.0f} / {worst_ms:.0f} ms): "
        + ", ".join(f"{w:.0f} / {p:.0f} / {m:.0f} ({n})" for w, p, m, n in tries)
    )
