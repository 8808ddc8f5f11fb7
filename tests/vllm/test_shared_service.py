"""Two vLLM instances with our connector share one disk folder and one cache service.

`first` is the session's `b` (tiny_pair.py; after test_restart.py, the process it
restarted), whose engine core started the service; `second`, a new process with
the same flags, joins that service. `second` (which never saw `first`'s prompts)
is served them from disk through the shared service before, during and after
`first` stops on SIGINT (a Ctrl-C), with the same service process throughout: no
gap, no respawn. Then `second` stops on SIGTERM, the last lease ends and the
service exits; neither leaves a segment in /dev/shm (ours, nor multiprocessing's
psm_* / sem.mp-*).
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from processes import children_of, pid_alive
from shm_leftovers import wait_no_leftovers
from tiny_pair import TinyPair
from vllm_helpers import (
    hit_after,
    hits,
    prompt,
    server,
    stored_since,
    wait_for,
)

from asynchicache.bench.processes.vllm_process import VllmServer
from asynchicache.integrations.vllm.l2.service_process import (
    service_holder,
    service_pid,
    wait_service_gone,
)

# A vLLM start takes 30-120 s on 2 busy cores.
pytestmark = pytest.mark.timeout(900)

N = 300  # prompt tokens: 18 full pages of 16 are loaded (vLLM computes the last token)
PAGES = (N - 1) // 16
PROMPTS = 4


def _engine_pids(s: VllmServer) -> list[int]:
    """The API server's children (its engine core among them)."""
    assert s.proc is not None
    return children_of(s.proc.pid)


def _disk_hit(s: VllmServer, tokens: list[int], want: str) -> None:
    """`s` answers `tokens` as `want`, its prefix loaded from disk."""
    before = hits(s, "disk")
    assert s.complete(tokens)["choices"][0]["text"] == want
    assert hit_after(s, "disk", before, PAGES * 16) == PAGES * 16


@pytest.mark.slow
def test_the_second_instance_keeps_its_disk_hits_while_the_first_stops(
    tiny_pair: TinyPair, tmp_path: Path
) -> None:
    tiny_pair.stop("a")  # at most two vLLM servers at once
    first = tiny_pair.server("b")
    before = tiny_pair.shm_before["b"]  # what either leaves is new since `first` started
    address = tiny_pair.socket("b")
    second = server(tiny_pair.flags("b"), tmp_path / "second.log")
    try:
        second.start()  # it joins `first`'s service
        holder = service_holder(address)
        assert holder is not None and pid_alive(holder[0])
        service, starter = holder
        assert starter in _engine_pids(first)
        prompts = [prompt(7000 + i, N) for i in range(PROMPTS)]
        base = stored_since(first, 0.0)
        texts = [first.complete(p)["choices"][0]["text"] for p in prompts]
        wait_for(lambda: stored_since(first, base) >= PROMPTS * PAGES, what="the prompts stored")

        _disk_hit(second, prompts[0], texts[0])
        with ThreadPoolExecutor(1) as pool:
            stopped = pool.submit(first.stop, 60, signal.SIGINT)  # a Ctrl-C
            _disk_hit(second, prompts[1], texts[1])  # while `first` shuts down
            assert stopped.result() == 0
        _disk_hit(second, prompts[2], texts[2])  # right after it exited
        time.sleep(2.0)  # the service has seen `first` gone (it sweeps every 0.5 s)
        _disk_hit(second, prompts[3], texts[3])
        assert service_pid(address) == service and pid_alive(service)

        assert second.stop(60, signal.SIGTERM) == 0  # the last instance
        assert wait_service_gone(address, 30)
        assert not pid_alive(service)
        assert wait_no_leftovers(before) == []
    finally:
        for s in (first, second):
            s.stop()
