"""Issue 22, finding 3: the KV event sockets leak nothing they need not, to no one they
need not, and survive a flood.

* endpoints: ipc:// in a private folder or inproc:// only, unless told: loopback tcp://
  (any local user may connect: issue 39, finding 10) wants CURVE keys or
  `--kv-events-plaintext`, and beyond this machine also `--kv-events-allow-remote`;
  `serve` refuses `tcp://*` and a bare loopback port before anything starts;
* with CURVE keys, only the listed clients read the events;
* a `cache_salt`'s pages go out with no token ids under keyed names, in every tier (L1,
  L2 and disk), live and in a replay: nothing derived from the salt (its root as a
  first page's parent, its pages' hashes) leaves (finding 10); the shared namespace's
  keep their token ids and plain hashes;
* the replay socket answers in batches of at most 10,000 events, and a flood of
  requests neither stalls the engine's tick nor keeps a real subscriber out.

Real sockets, a real cache (and cache service, for the disk tier) in this process.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from curve_certs import curve_certs
from kv_rig import PAGE, Rig, kv_rig, page_tokens
from serve_refusal import serve_refusal

from asynchicache.kv_events import wire
from asynchicache.kv_events.access import ClientCurve, CurveKeys
from asynchicache.kv_events.publisher import KvEventsConfig
from asynchicache.kv_events.replay import ReplayLimits
from asynchicache.kv_events.subscriber import KvEventSubscriber

MAX_EVENTS = 10_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- who may listen -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557", "tcp://eth0:5557",
     "tcp://example.com:5557", "tcp://[::]:5557", "ws://127.0.0.1:5557", "pgm://eth0;239.1.1.1:5555"],
)  # fmt: skip
def test_endpoints_beyond_this_machine_are_refused(address: str) -> None:
    with pytest.raises(ValueError, match="--kv-events-endpoint"):
        KvEventsConfig(address)
    with pytest.raises(ValueError, match="--kv-events-replay-endpoint"):
        KvEventsConfig("ipc:///nonexistent-private/ev.sock", address)


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5557", "tcp://[::1]:5557",
                                     "tcp://localhost:5557"])  # fmt: skip
def test_a_loopback_port_wants_curve_or_the_plaintext_flag(address: str) -> None:
    with pytest.raises(ValueError, match="every user of this machine"):
        KvEventsConfig(address)
    with pytest.raises(ValueError, match="--kv-events-replay-endpoint"):
        KvEventsConfig("inproc://events", address)
    KvEventsConfig(address, address, plaintext=True)


def test_private_endpoints_are_fine(tmp_path: Path) -> None:
    KvEventsConfig("inproc://events")
    KvEventsConfig(f"ipc://{tmp_path}/private/ev.sock")


_curve_keys = curve_certs


def test_a_remote_endpoint_wants_the_flag_and_curve_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--kv-events-allow-remote"):
        KvEventsConfig("tcp://*:5557")
    with pytest.raises(ValueError, match="CURVE"):
        KvEventsConfig("tcp://*:5557", allow_remote=True)
    KvEventsConfig("tcp://*:5557", allow_remote=True, plaintext=True)  # the operator's call
    keys, _, _ = _curve_keys(tmp_path)
    KvEventsConfig("tcp://*:5557", "tcp://*:5558", allow_remote=True, curve=keys)
    public_only = CurveKeys(keys.secret_key_file.with_suffix(".key"), keys.clients_dir)
    with pytest.raises(ValueError, match="no secret key"):
        KvEventsConfig("tcp://*:5557", allow_remote=True, curve=public_only)


def test_an_ipc_endpoint_in_a_folder_others_may_enter_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    with pytest.raises(ValueError, match="private"):
        KvEventsConfig(f"ipc://{shared}/ev.sock")
    KvEventsConfig(f"ipc://{tmp_path}/new/ev.sock")  # made 0700 when the engine binds
    assert os.stat(shared).st_mode & 0o777 == 0o755


def test_an_ipc_endpoint_in_a_symlinked_folder_is_refused(tmp_path: Path) -> None:
    # A symlink passes every check made through it (the folder it points to is ours and
    # 0700 now), then may be pointed elsewhere: the socket's folder must be a real one.
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(private)
    KvEventsConfig(f"ipc://{private}/ev.sock")
    with pytest.raises(ValueError, match="private"):
        KvEventsConfig(f"ipc://{link}/ev.sock")


def _serve_refusal(*argv: str) -> str | None:
    return serve_refusal("--no-disk-cache", *argv)


def test_serve_refuses_a_star_binding_before_starting(tmp_path: Path) -> None:
    message = _serve_refusal("--kv-events-endpoint", "tcp://*:5557")
    assert message is not None and "--kv-events-endpoint" in message
    assert "--kv-events-allow-remote" in message
    message = _serve_refusal("--kv-events-endpoint", "tcp://*:5557", "--kv-events-allow-remote")
    assert message is not None and "CURVE" in message
    message = _serve_refusal("--kv-events-endpoint", "tcp://127.0.0.1:5557")
    assert message is not None and "--kv-events-plaintext" in message
    assert _serve_refusal("--kv-events-endpoint", "tcp://127.0.0.1:5557",
                          "--kv-events-plaintext") is None  # fmt: skip
    assert _serve_refusal("--kv-events-endpoint", f"ipc://{tmp_path}/ev.sock") is None


def test_only_listed_curve_clients_read_the_events(tmp_path: Path) -> None:
    keys, listed, unlisted = _curve_keys(tmp_path)
    pub, rep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    server_public = keys.secret_key_file.with_suffix(".key")
    with kv_rig(tmp_path, disk_pages=None, endpoint=pub, replay_endpoint=rep, curve=keys) as rig:
        friend = KvEventSubscriber(pub, rep, curve=ClientCurve(server_public, listed))
        stranger = KvEventSubscriber(pub, rep, curve=ClientCurve(server_public, unlisted))
        plain = KvEventSubscriber(pub, rep)
        try:
            for sub in (friend, stranger, plain):
                sub.request_replay()
            time.sleep(0.5)  # handshakes (refused ones too)
            rig.put(1, 2)
            deadline = time.monotonic() + 20
            while not (friend.synced and friend.counts()["device"] == 2):
                assert time.monotonic() < deadline, "the listed client got nothing"
                rig.publisher.tick()
                friend.poll(50)
            for _ in range(20):
                rig.publisher.tick()
                for sub in (stranger, plain):
                    sub.poll(10)
            assert stranger.last is None and plain.last is None
            assert stranger.counts()["device"] == plain.counts()["device"] == 0
        finally:
            for sub in (friend, stranger, plain):
                sub.close()


# -- what goes out --------------------------------------------------------------------------

SECRET_PAGES = (71, 72, 73)  # a tenant's prompt (salted)
SHARED_PAGES = (81, 82)  # a prompt of the shared namespace


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with kv_rig(tmp_path, device_pages=8, host_pages=8, disk_pages=16) as made:
        yield made


class _Recorder(KvEventSubscriber):
    """A subscriber that keeps every BlockStored it applied (live and replayed)."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.stored: list[wire.BlockStored] = []
        super().__init__(endpoint, replay)

    def _apply(self, number: int, batch: wire.KVEventBatch) -> None:
        self.stored += [e for e in batch.events if isinstance(e, wire.BlockStored)]
        super()._apply(number, batch)


def _catch_up(rig: Rig, sub: KvEventSubscriber) -> None:
    """A replay asked for and applied (the engine's ticks answer it)."""
    sub.request_replay()
    deadline = time.monotonic() + 30
    while not sub.synced:
        assert time.monotonic() < deadline, "no replay"
        rig.publisher.tick()
        sub.poll(10)


def test_salted_pages_go_out_with_no_tokens_under_keyed_names(rig: Rig) -> None:
    sub = _Recorder(rig.endpoint, rig.replay)
    try:
        sub.request_replay()
        rig.put(*SECRET_PAGES, salt="tenant-secret")
        rig.put(*SHARED_PAGES)
        rig.quiet(sub)
        late = _Recorder(rig.endpoint, rig.replay)  # gets everything from a replay
        try:
            _catch_up(rig, late)
            late_stored = late.stored
        finally:
            late.close()
    finally:
        sub.close()
    secret = set(page_tokens(*SECRET_PAGES))
    shared = page_tokens(*SHARED_PAGES)
    # Everything derived from the salt: the salted pages' hashes and their chain's root.
    tree = rig.cache.tree
    derived = set()
    for node in tree.iter_nodes():
        if secret & set(node.tokens):
            derived.update(node.hashes)
            assert node.parent is not None
            derived.add(tree.last_hash(node.parent))  # the salt's root, for a first node
    plain = {wire.external_hash(h) for h in derived}
    assert len(derived) >= len(SECRET_PAGES) + 1
    for events, how in ((sub.stored, "live"), (late_stored, "replay")):
        media = {e.medium for e in events}
        assert {"GPU", "CPU", "DISK"} <= media, (how, media)
        leaked = [e for e in events if secret & set(e.token_ids)]
        assert leaked == [], f"{how}: a salted prompt's token ids went out"
        secret_runs = [e for e in events if not e.token_ids]
        assert {e.medium for e in secret_runs} >= {"GPU", "CPU", "DISK"}, how
        assert sum(len(e.block_hashes) for e in secret_runs) >= 3 * len(SECRET_PAGES), how
        for e in events:  # no salt-derived name goes out, as a page or as a parent
            assert not set(e.block_hashes) & plain, how
            assert e.parent_block_hash not in plain, how
        # The shared prompt's pages keep their tokens where the engine knows them, and a
        # first page has no parent (the namespace's root never goes out).
        shared_runs = [e for e in events if e.token_ids[:PAGE] == tuple(shared[:PAGE])]
        assert {e.medium for e in shared_runs} >= {"GPU", "CPU"}, how
        assert all(e.parent_block_hash is None for e in shared_runs), how
        assert wire.external_hash(tree.root_hash) not in {e.parent_block_hash for e in events}


# -- the replay socket ----------------------------------------------------------------------


def _fill(rig: Rig, pages: int, per_prompt: int = 50, start: int = 0) -> None:
    for first in range(start, start + pages, per_prompt):
        rig.put(*range(1000 + first, 1000 + first + per_prompt))


def test_replays_come_in_batches_of_at_most_10000_events(tmp_path: Path) -> None:
    pages = 12_000
    # A buffer of 4 batches: batch 0 is long gone when the asker comes.
    with kv_rig(tmp_path, device_pages=pages, host_pages=8, disk_pages=None,
                interval_s=0.0, replay=ReplayLimits(buffer_steps=4)) as rig:  # fmt: skip
        for start in range(0, pages, 1000):
            _fill(rig, 1000, start=start)
            rig.publisher.tick()
        assert rig.publisher.seq > 4
        ctx = zmq.Context()
        asker = ctx.socket(zmq.DEALER)
        asker.setsockopt(zmq.LINGER, 0)
        asker.setsockopt(zmq.RCVTIMEO, 100)
        asker.connect(rig.replay)
        try:
            batches = []
            asker.send_multipart([b"", wire.seq_frame(0)])  # vLLM's request: from batch 0
            while True:
                rig.publisher.tick()
                try:
                    _empty, _topic, seq, payload = asker.recv_multipart()
                except zmq.Again:
                    continue
                if wire.read_seq(seq) == wire.END_SEQ:
                    break
                assert len(payload) < 2_000_000  # one frame never holds the whole cache
                batch = wire.decode(payload)
                assert sum(wire.weight(e) for e in batch.events) <= MAX_EVENTS
                batches.append((wire.read_seq(seq), batch))
            resync = [b for _, b in batches if any(isinstance(e, wire.AllBlocksCleared)
                                                   for e in b.events)]  # fmt: skip
            assert len(resync) == 1  # the start (0) was older than the buffer: a resync
            assert len(batches) == 2  # 12,000 pages in two batches, from AllBlocksCleared on
            numbers = [n for n, _ in batches]
            assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
            device = {h for _, b in batches for e in b.events if isinstance(e, wire.BlockStored)
                      and e.medium == "GPU" for h in e.block_hashes}  # fmt: skip
            assert len(device) == pages
        finally:
            asker.close()
            ctx.term()
        sub = KvEventSubscriber(rig.endpoint, rig.replay)
        try:
            _catch_up(rig, sub)
            assert sub.counts()["device"] == pages and sub.replays == 1
        finally:
            sub.close()


def test_a_flood_of_replay_requests_stalls_nothing(tmp_path: Path) -> None:
    pages = 3_000
    with kv_rig(tmp_path, device_pages=pages, host_pages=8, disk_pages=None) as rig:
        _fill(rig, pages)
        rig.publisher.tick()
        ctx = zmq.Context()
        flooders = []
        for _ in range(8):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.setsockopt(zmq.RCVHWM, 10)  # it never reads: its answers are dropped
            s.connect(rig.replay)
            flooders.append(s)
        sent = 0
        sub = KvEventSubscriber(rig.endpoint, rig.replay)
        try:
            for _ in range(5_000):
                for s in flooders:
                    with contextlib.suppress(zmq.Again):
                        s.send_multipart([b"", wire.seq_frame(0)], zmq.NOBLOCK)
                        sent += 1
            sub.request_replay()
            ticks, started = [], time.monotonic()
            while not sub.synced:
                assert time.monotonic() - started < 30, "the real subscriber was kept out"
                t = time.perf_counter()
                rig.publisher.tick()
                ticks.append(time.perf_counter() - t)
                sub.poll(0)
                rig.put(5000 + len(ticks) % 3)  # the engine keeps working meanwhile
            elapsed = time.monotonic() - started
            replays = rig.publisher.replays
            resyncs = rig.publisher.resyncs
        finally:
            sub.close()
            for s in flooders:
                s.close()
            ctx.term()
    assert sent >= 8_000
    assert sub.counts()["device"] >= pages - 8
    assert max(ticks) < 1.0, f"a tick took {max(ticks):.2f}s"
    assert sorted(ticks)[len(ticks) // 2] < 0.05
    assert replays is not None
    assert resyncs <= elapsed / replays.limits.min_interval_s + 2
    assert replays.answered <= replays.limits.per_tick * len(ticks)
