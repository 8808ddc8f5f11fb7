"""The fault matrix on one live server (SmolLM2, small L1/L2 so the disk tier works hard):

1. kill -9 of the cache service at random moments under load;
2. page files flipped, truncated, deleted and replaced while serving;
3. kill -9 of every server process during heavy writes, then a restart on the same folder.

Each runs under concurrent greedy requests whose cold answers are known, and
records faults injected, requests served / failed, wrong outputs and, for
corruption, pages detected / served (fault_helpers.record).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from fault_helpers import (
    FaultRecord,
    Matrix,
    files_by_prompt,
    knob,
    page_files,
    page_tokens,
    record,
    temp_files,
    verify_disk,
)
from live_server import LiveServer, corrupt_detected
from settling import at_most
from traffic import (
    PAGE_SIZE,
    Load,
    Prompt,
    RequestFailed,
    ask_all,
    complete,
    make_prompts,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

# `/cache/clear`'s default scope takes the disk too: these tests drop L1/L2 only, so that
# prompts are asked again from the (damaged) files.
L1_L2 = {"scope": ["device", "host"]}
CORRUPTIONS = ("flip_header", "flip_padding", "flip_payload", "truncate", "delete", "replace")


def _storage(server: LiveServer) -> dict:
    return server.stats().get("storage") or {}


def _wait_service_ready(server: LiveServer, timeout_s: float = 60.0) -> dict:
    """Storage stats once the (new) service has the engine registered and its index built."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        storage = _storage(server)
        disk = storage.get("disk") or {}
        registered = (storage.get("service") or {}).get("clients", 0) >= 1
        if registered and (disk.get("extra") or {}).get("index_ready") == 1.0:
            return storage
        time.sleep(0.25)
    raise AssertionError(f"the cache service did not come back:\n{server.log_tail()}")


def test_cache_service_kill9_under_load(matrix: Matrix) -> None:
    server, rng = matrix.server, random.Random(11)
    kills, gap = knob("service_kills"), knob("kill_gap_s")
    completed: set[Path] = set()
    t0 = time.monotonic()
    with Load(server.url, matrix.prompts, matrix.expected, knob("clients")) as load:
        for _ in range(kills):
            # Each kill strikes a service that has the engine registered and has served
            # requests, at a random moment after that (full: gap > stable_s, no crash loop).
            _wait_service_ready(server)
            if not load.served_more(1, 120):
                raise AssertionError(f"no request served under load: {load.result.failures[:5]}")
            time.sleep(rng.uniform(1.0, 1.5) * gap)
            completed |= set(page_files(matrix.disk))  # pages whose store finished
            victim = server.pids()["cache-service"]
            os.kill(victim, signal.SIGKILL)
            server.wait_role("cache-service", victim)
        _wait_service_ready(server)
        disk_tokens_before = load.result.tiers.get("disk", 0)
        # The restarted service serves the disk tier again (the phase ends once it did).
        at_most(knob("phase_s"), lambda: load.result.tiers.get("disk", 0) > disk_tokens_before)
    result = load.result
    lost = sorted(p.name for p in completed if not p.exists())
    storage = _wait_service_ready(server)
    record(
        FaultRecord(
            "kill -9 cache service",
            kills,
            result.served,
            result.failed,
            result.wrong,
            seconds=time.monotonic() - t0,
            notes={
                "pages_kept": len(completed) - len(lost),
                "pages_lost": len(lost),
                "disk_tokens_after_last_restart": result.tiers.get("disk", 0) - disk_tokens_before,
                "cached_tokens_by_tier": result.tiers,
            },
        )
    )
    assert result.failed == 0 and result.wrong == 0, result.failures[:10]
    assert result.served > kills
    assert lost == [], f"completed pages lost: {lost[:10]}"
    assert verify_disk(matrix.disk) == 0
    assert storage["disk"]["pages"] == len(page_files(matrix.disk))  # the index was rebuilt
    assert result.tiers.get("disk", 0) > 0, "the disk tier was never read"
    assert server.proc is not None and server.proc.poll() is None


def _flip(path: Path, rng: random.Random, lo: int, hi: int) -> None:
    offset = rng.randrange(lo, hi)
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ rng.randrange(1, 256)]))


def _corrupt(path: Path, kind: str, rng: random.Random, donor: Path) -> None:
    size = path.stat().st_size
    header_used = 256  # the fields of a default-model header end well before this
    if kind == "flip_header":
        _flip(path, rng, 0, header_used)
    elif kind == "flip_padding":
        _flip(path, rng, header_used, 4096)
    elif kind == "flip_payload":
        _flip(path, rng, 4096, size)
    elif kind == "truncate":
        os.truncate(path, rng.randrange(size))
    elif kind == "delete":
        path.unlink()
    elif kind == "replace":  # a valid page file, but another page's
        tmp = path.with_name(".swap")
        shutil.copyfile(donor, tmp)
        os.replace(tmp, path)
    else:
        raise ValueError(kind)


def test_corrupt_files_are_detected_and_never_served(matrix: Matrix) -> None:
    """Background load on half the prompts; the other half's files are damaged, L1/L2
    dropped, and those prompts asked again: every damaged page is detected, none served."""
    server, rng = matrix.server, random.Random(23)
    half = len(matrix.prompts) // 2
    background, targets = matrix.prompts[:half], matrix.prompts[half:]
    donors = [p for files in files_by_prompt(matrix.disk, background).values() for p in files]
    wanted, injected, kinds = knob("corruptions"), 0, Counter[str]()
    detected_before = corrupt_detected(server)
    t0 = time.monotonic()
    checked = []
    with Load(server.url, background, matrix.expected, max(1, knob("clients") - 1)) as load:
        while injected < wanted:
            round_ = _corrupt_round(matrix, targets, wanted - injected, rng, donors, kinds)
            injected += len(round_)
            full = sum(len(p.pages) * PAGE_SIZE for p in round_)
            for _ in range(4):  # a load the engine chose to skip (cost model) reads nothing
                httpx.post(server.url + "/cache/clear", json=L1_L2, timeout=60).raise_for_status()
                checked.append(ask_all(server.url, round_, matrix.expected))
                # usage counts only what was loaded: each damaged prompt recomputed a part
                assert checked[-1].tiers.get("disk", 0) < full, checked[-1].tiers
                if corrupt_detected(server) - detected_before >= injected:
                    break
            assert verify_disk(matrix.disk) == 0, "a damaged file is still there"
    detected = corrupt_detected(server) - detected_before
    served = sum(r.served for r in checked) + load.result.served
    failed = sum(r.failed for r in checked) + load.result.failed
    wrong = sum(r.wrong for r in checked) + load.result.wrong
    record(
        FaultRecord(
            "corrupt page files while serving",
            injected,
            served,
            failed,
            wrong,
            corrupt_detected=int(detected),
            corrupt_served=wrong,
            seconds=time.monotonic() - t0,
            notes={"kinds": dict(kinds)},
        )
    )
    failures = [f for r in (*checked, load.result) for f in r.failures]
    assert failed == 0 and wrong == 0, failures[:10]
    assert detected == injected, (detected, injected, dict(kinds))


def _corrupt_round(
    matrix: Matrix,
    targets: list[Prompt],
    budget: int,
    rng: random.Random,
    donors: list[Path],
    kinds: Counter[str],
) -> list[Prompt]:
    """Damage one page file of each target prompt (not its last page, which a request
    always recomputes); returns the prompts damaged."""
    files = files_by_prompt(matrix.disk, targets)
    hit = []
    for prompt in targets[:budget]:
        last = prompt.pages[-1]
        candidates = [f for f in files[prompt.name] if page_tokens(f) != last]
        if not candidates:
            continue
        kind = CORRUPTIONS[sum(kinds.values()) % len(CORRUPTIONS)]
        _corrupt(rng.choice(candidates), kind, rng, rng.choice(donors))
        kinds[kind] += 1
        hit.append(prompt)
    assert hit, "no page file of the target prompts on disk"
    return hit


def test_kill9_whole_server_during_heavy_writes(matrix: Matrix) -> None:
    """Cold prompts written to disk by many clients; every process killed mid-way; the
    restarted server rebuilds its index, finds no partial file and serves from disk."""
    heavy = make_prompts(matrix.tok, "h", knob("heavy_prompts"))
    server = matrix.server
    answers: dict[str, str] = {}
    todo = list(heavy)
    lock = threading.Lock()

    def work() -> None:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    prompt = todo.pop()
                try:
                    answer = complete(client, prompt, stream=False)
                except RequestFailed:
                    return  # the kill
                with lock:
                    answers[prompt.name] = answer.text  # cold: no page shared with others

    threads = [threading.Thread(target=work, daemon=True) for _ in range(knob("clients") + 1)]
    for t in threads:
        t.start()
    while len(answers) < len(heavy) // 3:
        time.sleep(0.1)
    time.sleep(random.Random(5).uniform(0.0, 1.0))
    deadline = time.monotonic() + 20
    while not temp_files(matrix.disk) and time.monotonic() < deadline:
        time.sleep(0.002)  # strike while a page is being written
    pages_at_kill = len(page_files(matrix.disk))
    server.kill_all()
    for t in threads:
        t.join(60)
    leftovers = len(temp_files(matrix.disk))
    bad = verify_disk(matrix.disk)

    restarted = LiveServer(matrix.disk, matrix.root / "restarted.log").start()
    matrix.server = restarted
    t0 = time.monotonic()
    storage = _wait_service_ready(restarted)
    # Counted before any request: the answers below store pages the kill lost (their
    # stores were still waiting for a quiet engine, hierarchy/l2/store_queue.py).
    files_at_restart = len(page_files(matrix.disk))
    scan_detected = storage["disk"]["corrupt_detected"]
    done = [p for p in heavy if p.name in answers]
    expected = {**matrix.expected, **answers}
    after = ask_all(restarted.url, done + matrix.prompts[: len(done)], expected)
    record(
        FaultRecord(
            "kill -9 whole server during heavy writes",
            1,
            after.served,
            after.failed,
            after.wrong,
            corrupt_detected=int(bad + scan_detected),
            corrupt_served=after.wrong,
            seconds=time.monotonic() - t0,
            notes={
                "pages_on_disk_at_kill": pages_at_kill,
                "pages_indexed_after_restart": storage["disk"]["pages"],
                "temp_files_left_by_the_kill": leftovers,
                "cold_answers_before_kill": len(answers),
                "cached_tokens_by_tier": after.tiers,
            },
        )
    )
    assert bad == 0, "a partial or corrupt file exists under a real name"
    assert scan_detected == 0
    assert storage["disk"]["pages"] == files_at_restart >= pages_at_kill
    assert after.failed == 0 and after.wrong == 0, after.failures[:10]
    assert after.tiers.get("disk", 0) > 0, "nothing was served from disk after the restart"
    integrity = restarted.stats(integrity=True)["integrity"]
    assert integrity["ok"], integrity
