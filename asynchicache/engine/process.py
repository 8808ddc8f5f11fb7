"""The engine process: the `Engine` behind ZeroMQ sockets.

It PULLs `GenerateRequest` / `AbortRequest` / `AdminRequest` from the HTTP
process and PUSHes `TokenOutput` / `AdminReply` back. The socket is read on the
inbox's thread (engine/inbox.py), during steps too: a request is received,
decoded and stamped when it arrives, and the loop queues what arrived before
each step. When it has work the loop takes the inbox without waiting; when idle
it blocks on it with a short timeout so that background cache work
(write-through, stores) still completes. Idle or not, the cache is polled only
through the scheduler (`Engine.poll`, `Engine.step`), which takes or releases
every load ticket.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

import zmq

from asynchicache.engine.inbox import Inbox, Received
from asynchicache.engine.protocol import (
    AbortRequest,
    AdminRequest,
    GenerateRequest,
    StepOutputs,
    TokenOutput,
    encode,
)
from asynchicache.kv_events.publisher import KvEventsConfig
from asynchicache.settings.config import CacheConfig, EngineConfig
from asynchicache.storage.base import StorageTier

if TYPE_CHECKING:  # torch: imported in the engine process only, not by the launcher
    from asynchicache.engine.engine import Engine
    from asynchicache.engine.threads import ThreadGovernor
    from asynchicache.engine.upkeep import Upkeep

log = logging.getLogger(__name__)

# How long an idle engine waits for a message before its housekeeping turn (a message
# wakes it at once: the inbox's queue): short while background cache work (copies, stores, storage
# replies) is in flight, so it completes promptly; longer when nothing is, since each
# turn costs CPU (at 5 ms an idle server used ~2.5 CPU-s a minute).
IDLE_POLL_MS = 5
QUIET_POLL_MS = 50
SEND_WAIT_MS = 1000


@dataclass(frozen=True)
class EngineProcessConfig:
    """Everything the engine process needs; crosses the process boundary at spawn."""

    engine: EngineConfig
    cache: CacheConfig
    input_addr: str  # the engine PULLs requests here
    output_addr: str  # the engine PUSHes outputs here
    storage_addr: str | None = None  # the cache service's socket; None = no L3/L4
    storage_timeout_s: float = 10.0
    log_level: str = "INFO"
    kv_events: KvEventsConfig | None = None  # --kv-events-endpoint: publish KV events


def _connect_storage(config: EngineProcessConfig) -> StorageTier | None:
    """Connect to the cache service (imported lazily: it is optional)."""
    if config.storage_addr is None:
        return None
    from asynchicache.storage.client.client_config import ClientConfig
    from asynchicache.storage.client.storage_client import StorageClient

    events = config.kv_events is not None  # the service's L3/L4 events, relayed
    timeout = config.storage_timeout_s
    return StorageClient(ClientConfig(config.storage_addr, ticket_timeout_s=timeout, events=events))


class EngineLoop:
    """Pumps messages between the sockets and an `Engine`."""

    def __init__(
        self,
        engine: Engine,
        pull: zmq.Socket,
        push: zmq.Socket,
        upkeep: Upkeep | None = None,
        threads: ThreadGovernor | None = None,
    ) -> None:
        if upkeep is None:
            from asynchicache.engine.upkeep import Upkeep

            upkeep = Upkeep(engine)
        self.engine = engine
        self.inbox = Inbox(pull)  # reads `pull` on its own thread while `run` runs
        self.push = push
        self.upkeep = upkeep
        self.threads = threads
        self.stopping = False

    def _handle(self, received: Received) -> None:
        msg = received.msg
        if isinstance(msg, GenerateRequest):
            self._add(msg, received.at)
        elif isinstance(msg, AbortRequest):
            self.engine.abort(msg.rid, msg.index)
        elif isinstance(msg, AdminRequest):
            self._send(self.engine.admin(msg))
        else:
            log.warning("dropping an unexpected message type %s", type(msg).__name__)

    def _add(self, msg: GenerateRequest, arrived: float) -> None:
        """Queue a request (arrived when the inbox had it); one that cannot be queued is
        answered with an error, never allowed to end the loop (and every other request)."""
        try:
            early = self.engine.add_request(msg, arrived=arrived)
        except Exception as exc:
            from asynchicache.engine.isolation import failure_message

            log.exception("request %s could not be queued", msg.rid)
            error = failure_message("queueing", exc)
            n = len(msg.prompt_token_ids)
            early = TokenOutput(msg.rid, (), True, "error", n, 0, error=error)
        if early is not None:
            self._send(early)

    def _send(self, msg: object) -> None:
        """Send without blocking for long: a PUSH socket with no HTTP process connected (it
        stopped first at shutdown, or is gone) would block forever, and a blocked send
        retries through SIGTERM. Wait up to SEND_WAIT_MS for one, then drop the message."""
        data = encode(msg)
        try:
            self.push.send(data, zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            pass
        if self.push.poll(SEND_WAIT_MS, zmq.POLLOUT):
            self.push.send(data, zmq.NOBLOCK, copy=False)
        else:
            log.warning("no HTTP process takes outputs; dropped a %s", type(msg).__name__)

    def _drain(self, wait_ms: int) -> None:
        for received in self.inbox.take(wait_ms / 1000):
            self._handle(received)

    def _idle_wait_ms(self) -> int:
        return IDLE_POLL_MS if self.engine.cache.pending else QUIET_POLL_MS

    def _govern_threads(self) -> None:
        """Sample the machine between steps (engine/threads.py)."""
        if self.threads is None:
            return
        changed = self.threads.poll(idle=not self.engine.has_work)
        if changed is not None:
            log.info("torch threads of small steps now %d (what the other processes leave free)",
                     changed)  # fmt: skip

    def run(self) -> None:
        self.inbox.start()
        try:
            self._run()
        finally:
            self.inbox.close()  # the socket is the caller's again

    def _run(self) -> None:
        while not self.stopping:
            self._drain(0 if self.engine.has_work else self._idle_wait_ms())
            self._govern_threads()  # after the drain: it sees work arriving
            self.upkeep.tick()  # KV events out, pins refreshed (engine/upkeep.py)
            if not self.engine.has_work:
                self.engine.poll()  # finish write-throughs and stores while idle
                continue
            outputs: list[TokenOutput] = self.engine.step()
            if outputs:  # one message per step (see StepOutputs)
                self._send(StepOutputs(tuple(outputs)))
            if self.engine.last_batch_size == 0:
                # Only loads or background copies to wait for: don't spin a core.
                self._drain(1)


def run_engine(config: EngineProcessConfig) -> None:
    """Process entry point (spawned by the launcher)."""
    from setproctitle import setproctitle

    from asynchicache.engine.engine import Engine
    from asynchicache.engine.threads import ThreadGovernor
    from asynchicache.engine.upkeep import Upkeep

    setproctitle("asynchicache: engine")
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s engine %(levelname)s %(message)s"
    )
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(config.input_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never drop outputs
    push.bind(config.output_addr)
    governor = ThreadGovernor(config.engine.threads)
    threads = governor.apply()  # before the model exists: its first pool size
    storage = _connect_storage(config)
    engine = Engine(config.engine, config.cache, storage, step_threads=governor.for_step)
    engine.warm_up()
    upkeep = Upkeep.start(engine, config.kv_events, ctx)
    loop = EngineLoop(engine, pull, push, upkeep, governor)
    governor.start()  # measure the machine from ready on, not the model's loading

    def _stop(signum: int, frame: FrameType | None) -> None:
        loop.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info(
        "engine ready: model %s on %s, %d torch threads%s",
        engine.loaded.name,
        config.engine.device,
        threads,
        "" if governor.fixed is not None else " (then what the other processes leave)",
    )
    try:
        loop.run()
    finally:
        upkeep.close()
        engine.close()
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()
