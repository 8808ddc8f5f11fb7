"""AsynchicacheConnector under a real vLLM server, on a tiny random Llama.

The session's vLLM pair `a`, `b` (tiny_pair.py: our connector, a disk folder
and cache service each, one Redis) serves every test here; `plain` is vLLM
without a connector, run in the test process (inproc_vllm.py), for the
reference outputs. vLLM's own prefix cache is emptied through
/reset_prefix_cache and a few other prompts push a prompt out of the small L2:
then only our disk or Redis tier can serve the prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from inproc_vllm import PlainVllm
from processes import pid_alive
from redis_server import RedisServer
from tiny_pair import TinyPair
from vllm_helpers import (
    event,
    hit_after,
    hits,
    kill_service,
    page_files,
    prompt,
    stepped_hits,
    stored_since,
    text_of,
    wait_for,
)

from asynchicache.bench.processes.vllm_process import VllmServer
from asynchicache.integrations.vllm.l2.service_process import service_pid

# A vLLM start takes 30-120 s on 2 busy cores; the suite's 300 s per test is too tight
# for a test whose fixture starts servers.
pytestmark = pytest.mark.timeout(900)

N = 700  # prompt tokens: 43 full pages of 16 can be loaded (688 tokens; vLLM's
LOADED = 688  # blocks hold 128: the hit ends inside its sixth block, loaded in part)
FILLERS = 7  # 7 x 43 pages of other prompts push a prompt out of the 244-page L2


@dataclass
class Instances:
    plain: PlainVllm
    a: VllmServer
    b: VllmServer
    a_disk: Path
    a_socket: str
    redis: RedisServer
    fillers: int = 0

    def evict_l2(self, s: VllmServer) -> None:
        """Push everything out of `s`'s L2 (other prompts) and empty vLLM's prefix cache.
        Each filler's pages are stored before the next goes: a slot a store still reads
        is not evicted, so on a loaded machine fillers sent back to back find L2 full,
        skip their saves, and leave the prompt in L2."""
        for _ in range(FILLERS):
            self.fillers += 1
            before = event(s, "pages_stored") + event(s, "saves_skipped")
            s.complete(prompt(10_000 + self.fillers, N), max_tokens=1)
            wait_for(
                lambda b=before: placed_since(s, b) >= LOADED // 16, what="a filler's pages stored"
            )
        s.reset_prefix_cache()

    def redis_keys(self) -> int:
        return int(self.redis.cli("dbsize"))


def soon(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Whether `check` holds within `timeout_s` (stats reach /metrics a moment later)."""
    try:
        wait_for(check, timeout_s)
    except AssertionError:
        return False
    return True


def placed_since(s: VllmServer, before: float) -> float:
    """Pages stored or skipped (never placed in L2) since `before`."""
    return stored_since(s, before) + event(s, "saves_skipped")


@pytest.fixture(scope="module")
def vllms(tiny_pair: TinyPair, tiny_hf: Path) -> Iterator[Instances]:
    plain: PlainVllm | None = None
    try:
        with ThreadPoolExecutor(1) as pool:
            started = pool.submit(tiny_pair.servers)
            plain = PlainVllm(tiny_hf, kv_cache_bytes=32 << 20)  # while the servers start
            a, b = started.result()
        yield Instances(plain, a, b, tiny_pair.disk("a"), tiny_pair.socket("a"), tiny_pair.redis)
    finally:
        if plain is not None:
            plain.close()


def test_outputs_equal_plain_vllm_cold_and_from_each_tier(vllms: Instances) -> None:
    p = prompt(1, N)
    want = vllms.plain.text(p)
    assert text_of(vllms.a, p) == want  # cold: computed, saved to L2, disk and Redis
    host = hits(vllms.a, "host")
    vllms.a.reset_prefix_cache()
    assert text_of(vllms.a, p) == want
    assert hit_after(vllms.a, "host", host, LOADED) == LOADED
    vllms.evict_l2(vllms.a)
    disk = hits(vllms.a, "disk")
    assert text_of(vllms.a, p) == want
    assert hit_after(vllms.a, "disk", disk, LOADED) == LOADED


def test_cache_salt_isolates_tenants(vllms: Instances) -> None:
    p = prompt(2, N)
    want = vllms.plain.text(p)
    assert text_of(vllms.a, p, cache_salt="tenant-a") == want
    vllms.a.reset_prefix_cache()
    total = sum(hits(vllms.a, t) for t in ("host", "disk", "remote"))
    lookups = event(vllms.a, "lookups")
    assert text_of(vllms.a, p, cache_salt="tenant-b") == want
    assert text_of(vllms.a, p) == want  # no salt: a third tenant
    assert text_of(vllms.a, p, cache_salt="tenant-a") == want
    wait_for(lambda: event(vllms.a, "lookups") - lookups >= 3, what="three lookups")
    grown = sum(hits(vllms.a, t) for t in ("host", "disk", "remote")) - total
    assert grown == LOADED  # only tenant-a's second request hit


def test_second_instance_loads_the_first_ones_prompt_from_l4(vllms: Instances) -> None:
    p = prompt(3, N)
    want = vllms.plain.text(p)
    keys = vllms.redis_keys()
    assert text_of(vllms.a, p) == want
    wait_for(lambda: vllms.redis_keys() >= keys + LOADED // 16, what="uploads to Redis")
    remote = hits(vllms.b, "remote")
    assert text_of(vllms.b, p) == want  # b's first request for it
    assert hit_after(vllms.b, "remote", remote, LOADED) == LOADED


def test_redis_down_recomputes_and_l4_hits_resume(vllms: Instances) -> None:
    vllms.redis.kill()
    p = prompt(4, N)
    want = vllms.plain.text(p)
    assert text_of(vllms.a, p) == want  # stored on a's disk only
    assert text_of(vllms.b, p) == want  # nothing in L4: recomputed, not failed
    vllms.redis.start()
    seed, grown = 100_000, 0.0  # seeds of its own: the loop may run long

    def b_loads_from_l4() -> bool:
        """a's next prompt goes up to Redis, then b asks for it. Each service's breaker
        probes Redis again after its own backoff: b's may reopen later than a's."""
        nonlocal seed, grown
        seed += 1
        q, keys = prompt(seed, N), vllms.redis_keys()
        vllms.a.complete(q, max_tokens=1)
        if not soon(lambda: vllms.redis_keys() >= keys + LOADED // 16):
            return False  # a's link to Redis is not back yet
        remote = hits(vllms.b, "remote")
        assert text_of(vllms.b, q) == vllms.plain.text(q)  # from L4 or recomputed: the same
        loaded = soon(lambda: stepped_hits(vllms.b, "remote") - remote >= LOADED)
        grown = hits(vllms.b, "remote") - remote
        return loaded

    wait_for(b_loads_from_l4, timeout_s=90, what="L4 hits to resume")
    assert grown == LOADED  # the whole prompt, not a part


def test_corrupt_and_truncated_page_files_are_misses_then_hits_resume(
    vllms: Instances,
) -> None:
    vllms.redis.stop()  # no L4 to fall back on: a bad page must be recomputed
    try:
        p = prompt(5, N)
        want = vllms.plain.text(p)
        assert text_of(vllms.a, p) == want
        files: dict[int, list[Path]] = {}

        def all_stored() -> bool:
            nonlocal files
            files = page_files(vllms.a_disk, p)
            return len(files) >= LOADED // 16

        wait_for(all_stored, what="the prompt's pages stored")
        (flipped,), (cut,) = files[3], files[7]  # the prompt's own pages 3 and 7
        size = cut.stat().st_size
        data = bytearray(flipped.read_bytes())
        data[-100] ^= 0xFF
        flipped.write_bytes(bytes(data))
        cut.write_bytes(cut.read_bytes()[:4096])
        vllms.evict_l2(vllms.a)
        assert text_of(vllms.a, p) == want  # the bad pages are misses: recomputed
        # The service removed the bad files; the recomputed pages were saved again.
        wait_for(
            lambda: (
                cut.exists() and cut.stat().st_size == size and flipped.read_bytes() != bytes(data)
            ),
            what="the bad files replaced",
        )
        vllms.evict_l2(vllms.a)
        disk = hits(vllms.a, "disk")
        assert text_of(vllms.a, p) == want
        assert hit_after(vllms.a, "disk", disk, LOADED) == LOADED
    finally:
        vllms.redis.start()


def test_service_killed_mid_load_recomputes_then_hits_resume(vllms: Instances) -> None:
    prompts = [prompt(300_000 + i, N) for i in range(5)]
    wants = [vllms.plain.text(q) for q in prompts]
    stored = event(vllms.a, "pages_stored")
    for q, want in zip(prompts, wants, strict=True):
        assert text_of(vllms.a, q) == want
    wait_for(lambda: stored_since(vllms.a, stored) >= 5 * LOADED // 16)
    vllms.evict_l2(vllms.a)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(text_of, vllms.a, q) for q in prompts[:4]]
        killed = kill_service(vllms.a_socket)  # while their lookups and loads are in flight
        got = [f.result() for f in futures]
    assert got == wants[:4]  # no failed request, no wrong output
    wait_for(
        lambda: (pid := service_pid(vllms.a_socket)) not in (None, killed) and pid_alive(pid),
        timeout_s=60,
        what="the connector to start a new service",
    )

    def connected() -> bool:  # a cold probe's lookup reached the new service
        vllms.fillers += 1
        down = event(vllms.a, "service_unavailable")
        vllms.a.complete(prompt(20_000 + vllms.fillers, 200), max_tokens=1)
        return event(vllms.a, "service_unavailable") == down

    wait_for(connected, timeout_s=60, what="the connector to reach the new service")
    vllms.a.reset_prefix_cache()
    disk = hits(vllms.a, "disk")
    assert text_of(vllms.a, prompts[4]) == wants[4]  # on disk only
    assert hit_after(vllms.a, "disk", disk, LOADED) == LOADED
