"""Issue 22, finding 3: the KV event sockets leak nothing they need not, to no one they
need not, and survive a flood.

* endpoints: ipc:// in a private folder, loopback tcp:// or inproc:// only, unless
  `--kv-events-allow-remote`, and a remote endpoint wants ZeroMQ CURVE keys (refused
  without them); `serve` refuses `tcp://*` before anything starts;
* with CURVE keys, only the listed clients read the events;
* a `cache_salt`'s pages go out as hashes only, in every tier (L1, L2 and disk), live
  and in a replay; the shared namespace's keep their token ids;
* the replay socket answers in parts of at most 10,000 events, and a flood of
  requests neither stalls the engine's tick nor keeps a real subscriber out.

Real sockets, a real cache (and cache service, for the disk tier) in this process.
"""

from __future__ import annotations

import contextlib
import io
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from kv_rig import PAGE, Rig, kv_rig, page_tokens

from asynchicache.engine.kv_event_access import ClientCurve, CurveKeys
from asynchicache.engine.kv_event_messages import decode, read_seq, seq_frame
from asynchicache.engine.kv_events import KvEventsConfig
from asynchicache.engine.kv_subscriber import KvEventSubscriber
from asynchicache.tiers import BlockStored

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


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:5557",
                "inproc://events"],
)  # fmt: skip
def test_local_endpoints_are_fine(address: str) -> None:
    KvEventsConfig(address)


def _curve_keys(tmp_path: Path) -> tuple[CurveKeys, Path, Path]:
    """(the server's keys, a listed client's certificate, an unlisted client's)."""
    import zmq.auth

    server_dir, clients_dir, others_dir = (tmp_path / n for n in ("server", "clients", "others"))
    for d in (server_dir, clients_dir, others_dir):
        d.mkdir(mode=0o700)
    _, server_secret = zmq.auth.create_certificates(str(server_dir), "server")
    _, client_secret = zmq.auth.create_certificates(str(clients_dir), "router")
    _, other_secret = zmq.auth.create_certificates(str(others_dir), "stranger")
    for secret in (client_secret, other_secret):  # the listed folder keeps public keys only
        os.replace(secret, tmp_path / Path(secret).name)
    keys = CurveKeys(Path(server_secret), clients_dir)
    return keys, tmp_path / Path(client_secret).name, tmp_path / Path(other_secret).name


def test_a_remote_endpoint_wants_the_flag_and_curve_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--kv-events-allow-remote"):
        KvEventsConfig("tcp://*:5557")
    with pytest.raises(ValueError, match="CURVE"):
        KvEventsConfig("tcp://*:5557", allow_remote=True)
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


def _serve_refusal(*argv: str) -> str | None:
    from asynchicache.server.options import parse_args, to_config

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            to_config(parse_args(["--device", "cpu", "--no-disk-cache", *argv]))
        except SystemExit:
            return err.getvalue()
        except ValueError as exc:
            return str(exc)
    return None


def test_serve_refuses_a_star_binding_before_starting(tmp_path: Path) -> None:
    message = _serve_refusal("--kv-events-endpoint", "tcp://*:5557")
    assert message is not None and "--kv-events-endpoint" in message
    assert "--kv-events-allow-remote" in message
    message = _serve_refusal("--kv-events-endpoint", "tcp://*:5557", "--kv-events-allow-remote")
    assert message is not None and "CURVE" in message
    assert _serve_refusal("--kv-events-endpoint", "tcp://127.0.0.1:5557") is None


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
        self.stored: list[BlockStored] = []
        super().__init__(endpoint, replay)

    def _apply(self, batch) -> None:  # type: ignore[no-untyped-def]
        self.stored += [e for e in batch.events if isinstance(e, BlockStored)]
        super()._apply(batch)


def _catch_up(rig: Rig, sub: KvEventSubscriber) -> None:
    """A replay asked for and applied (the engine's ticks answer it)."""
    sub.request_replay()
    deadline = time.monotonic() + 30
    while not sub.synced:
        assert time.monotonic() < deadline, "no replay"
        rig.publisher.tick()
        sub.poll(10)


def test_salted_pages_go_out_as_hashes_only(rig: Rig) -> None:
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
    for events, how in ((sub.stored, "live"), (late_stored, "replay")):
        tiers = {e.tier for e in events}
        assert {"device", "host", "disk"} <= tiers, (how, tiers)
        leaked = [e for e in events if secret & set(e.token_ids)]
        assert leaked == [], f"{how}: a salted prompt's token ids went out"
        secret_runs = [e for e in events if not e.token_ids]
        assert {e.tier for e in secret_runs} >= {"device", "host", "disk"}, how
        assert sum(len(e.block_hashes) for e in secret_runs) >= 3 * len(SECRET_PAGES), how
        # The shared prompt's pages keep their tokens where the engine knows them (the
        # disk tier's events name pages by hash: the service does not send tokens).
        shared_runs = [e for e in events if e.token_ids[:PAGE] == tuple(shared[:PAGE])]
        assert {e.tier for e in shared_runs} >= {"device", "host"}, how


# -- the replay socket ----------------------------------------------------------------------


def _fill(rig: Rig, pages: int, per_prompt: int = 50) -> None:
    for start in range(0, pages, per_prompt):
        rig.put(*range(1000 + start, 1000 + start + per_prompt))


def _ask(sock: zmq.Socket, *frames: bytes) -> tuple[int, object]:
    sock.send_multipart([b"", b"replay", *frames])
    _empty, seq, payload = sock.recv_multipart()
    return read_seq(seq), decode(payload)


def test_replays_come_in_parts_of_at_most_10000_events(tmp_path: Path) -> None:
    pages = 12_000
    with kv_rig(tmp_path, device_pages=pages, host_pages=8, disk_pages=None,
                interval_s=0.0) as rig:  # fmt: skip
        _fill(rig, pages)
        rig.publisher.tick()
        ctx = zmq.Context()
        asker = ctx.socket(zmq.DEALER)
        asker.setsockopt(zmq.LINGER, 0)
        asker.setsockopt(zmq.RCVTIMEO, 100)
        asker.connect(rig.replay)
        try:
            parts = []
            asker.send_multipart([b"", b"replay"])
            while True:
                rig.publisher.tick()
                try:
                    _empty, seq, payload = asker.recv_multipart()
                except zmq.Again:
                    continue
                assert len(payload) < 2_000_000  # one frame never holds the whole cache
                batch = decode(payload)
                weight = sum(len(e.block_hashes) if isinstance(e, BlockStored) else 1
                             for e in batch.events)  # fmt: skip
                assert weight <= MAX_EVENTS and read_seq(seq) == batch.seq
                parts.append(batch)
                if len(parts) == batch.parts:
                    break
                asker.send_multipart([b"", b"replay", seq_frame(batch.seq),
                                      seq_frame(len(parts))])  # fmt: skip
            assert len(parts) == 2 and [p.part for p in parts] == [0, 1]
            device = {h for p in parts for e in p.events if isinstance(e, BlockStored)
                      and e.tier == "device" for h in e.block_hashes}  # fmt: skip
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
                        s.send_multipart([b"", b"replay"], zmq.NOBLOCK)
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
    assert replays.snapshots_taken <= elapsed / replays.limits.min_interval_s + 2
    assert replays.answered <= replays.limits.per_tick * len(ticks)
