"""An instance restarts: within a heartbeat vllm-router (a real process) sees its batch
numbers go back and drops what it announced, so no request is routed on the L1 pages the
restart lost (issue 38). The router restarts: within 5 s it credits what the instances
held before, from their replay sockets (`--kv-event-replay-source`).

Not yet: the pages the restart kept (L3, L4) are not credited again. vllm-router 0.1.17
drops the instance's pool-owned (L4) blocks with its own, and the restarted instance
announces its L3/L4 pages without tokens (the cache service lists them by hash only),
which no router can match: docs/fleet.md."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fleet_rig import Fleet, Instance, fleet, fleet_on_redis, lookup, prompt, send

from asynchicache.bench.fleet.fleet_router import Credits, RouterConfig, VllmRouter
from asynchicache.bench.processes.server_process import BenchServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CREDITS = Credits(host=0.8, disk=0.3, external=0.6)


@pytest.fixture
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet_on_redis(
        tmp_path_factory.mktemp("restart"), (), RouterConfig(credits=CREDITS)
    ) as made:
        yield made


def _restart(instance: Instance) -> BenchServer:
    """`instance`'s server started again on its port (the router knows it by its URL) and
    ready (its cache service too); the fixture stops it."""
    again = BenchServer(
        instance.server.flags, instance.server.log_path, instance.server.startup_timeout_s
    )
    again.port = instance.server.port
    again._start_once()
    instance.server.proc = again.proc
    deadline = time.monotonic() + 120
    while httpx.get(instance.url + "/ready", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the restarted instance never got ready"
        time.sleep(0.5)
    return again


def _credited_on(pair: Fleet, instance: Instance, text: str, within_s: float) -> int:
    """The tokens the router credits when it routes `text` to `instance`, once it does
    (asked every 0.5 s, at most `within_s`)."""
    deadline = time.monotonic() + within_s
    while True:
        decision, _ = pair.route(text)
        if decision.worker == instance.url and decision.credited > 0:
            return decision.credited
        assert time.monotonic() < deadline, decision
        time.sleep(0.5)


def test_a_restart_drops_its_own_tiers_from_the_router_but_not_l4(pair: Fleet) -> None:
    b = pair.instances[1]
    text = prompt(77, 80)
    send(b.url, text)
    full = _credited_on(pair, b, text + " first", 60.0)  # L1 first (and Redis meanwhile)
    time.sleep(2.0)  # write-through to L4
    b.server.stop()
    again = _restart(b)
    try:
        held = lookup(b.url, text)
        assert held["disk"] + held["remote"] >= full - 16, held  # L3 and L4 kept its pages
        time.sleep(3.0)  # its batches (heartbeats at least), numbered from 0, reach the router
        decision, usage = pair.route(text + " second")
        assert decision.credited < full, decision  # not at L1's credit: those pages are gone
        if decision.worker == b.url:  # its L3/L4 still serve it
            assert usage["disk"] + usage["remote"] >= full - 16, usage
    finally:
        b.server.proc = again.proc


def test_a_restarted_router_credits_what_the_instances_held_within_5_s(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("router-restart")
    with fleet(root, flags=("--no-disk-cache",)) as pair:
        b = pair.instances[1]
        text = prompt(78, 80)
        send(b.url, text)
        steady = _credited_on(pair, b, text + " first", 20.0)  # b's L1 pages, full credit
        pair.router.stop()
        again = VllmRouter(pair.router.config, pair.router.workers, root / "router-2.log")
        pair.router = again
        try:
            again.start()  # its /health answers
            started = time.monotonic()
            while True:  # it learns b's holdings from b's replay socket, not from new traffic
                try:
                    decision, _ = pair.route(text + " again")
                except httpx.HTTPStatusError:  # its workers are not in yet
                    decision = None
                if decision and decision.worker == b.url and decision.credited >= steady:
                    break
                assert time.monotonic() - started < 5.0, decision
                time.sleep(0.2)
        finally:
            again.stop()


def test_an_instance_killed_mid_run_fails_only_what_it_had_and_is_not_routed_to_after(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """One client sends distinct prompts through the router, one after the other, while
    the instance that holds a prompt is killed (SIGKILL, its whole process group) and
    started again: only a request already on it may fail, and once it is back the prompt
    it held (L1 only: no disk, no L4) is credited nowhere."""
    root = tmp_path_factory.mktemp("kill")
    with fleet(root, flags=("--no-disk-cache",)) as pair:
        b = pair.instances[1]
        held = prompt(79, 80)
        send(b.url, held)
        outcomes: list[tuple[int, str | None]] = []  # (decisions logged before it, error)
        stop = threading.Event()

        def client() -> None:
            for k in range(10_000):
                if stop.is_set():
                    return
                seen = len(pair.router.decisions())
                try:
                    send(pair.router.url, prompt(1000 + k, 40))
                    outcomes.append((seen, None))
                except httpx.HTTPError as exc:
                    outcomes.append((seen, repr(exc)))

        thread = threading.Thread(target=client)
        thread.start()
        try:
            time.sleep(2.0)
            killed_at = len(pair.router.decisions())
            b.server.stop(sig=signal.SIGKILL)
            time.sleep(2.0)  # traffic goes on while it is down
            _restart(b)
            time.sleep(2.0)  # its batches, numbered from 0 again, reach the router
        finally:
            stop.set()
            thread.join(120)
        decisions = pair.router.decisions()
        for seen, error in outcomes:
            if error is not None:  # only a request routed to b before the kill may fail
                assert seen < killed_at and decisions[seen].worker == b.url, (seen, error)
        assert sum(e is None for _, e in outcomes) >= len(outcomes) - 1, outcomes
        decision, _ = pair.route(held + " again")
        assert decision.credited == 0, decision  # b lost it; nobody else had it
