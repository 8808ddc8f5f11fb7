"""`LoopHarness`: an `Engine` behind the real `EngineLoop`, on a thread, over ZeroMQ sockets.

The engine process's loop, minus the process: requests, aborts and admin calls
go through the same sockets and messages, and idle periods run the loop's own
idle path. After `stop()` the test may inspect the engine directly.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from asynchicache.engine.engine import Engine
from asynchicache.engine.process import EngineLoop
from asynchicache.engine.protocol import (
    AdminReply,
    AdminRequest,
    GenerateRequest,
    SamplingParams,
    StepOutputs,
    TokenOutput,
    decode,
    encode,
)


class LoopHarness:
    """Drive `engine` through an `EngineLoop` running on a thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ctx = zmq.Context()
        name = f"inproc://loop-{id(self)}"
        pull, push = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        pull.bind(f"{name}-in")
        push.bind(f"{name}-out")
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.connect(f"{name}-in")
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.connect(f"{name}-out")
        self.loop = EngineLoop(engine, pull, push)
        self.thread = threading.Thread(target=self.loop.run, name="engine-loop", daemon=True)
        self.thread.start()
        self._sockets = (pull, push, self.send_sock, self.recv_sock)
        self._ids = itertools.count()
        self._outputs: list[TokenOutput] = []

    def _recv(self, timeout_s: float) -> object:
        if not self.recv_sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"the engine loop sent nothing for {timeout_s} s")
        return decode(self.recv_sock.recv())

    def send(self, prompt: Sequence[int], sampling: SamplingParams) -> str:
        """Send one request; returns its rid (`collect` gathers its outputs)."""
        rid = f"h{next(self._ids)}"
        self.send_sock.send(encode(GenerateRequest(rid, tuple(prompt), sampling)))
        return rid

    def collect(self, rids: Sequence[str], timeout_s: float = 120) -> list[TokenOutput]:
        """Each request's final output (all its tokens), in the order of `rids`."""
        tokens: dict[str, list[int]] = {rid: [] for rid in rids}
        final: dict[str, TokenOutput] = {}
        deadline = time.monotonic() + timeout_s
        while len(final) < len(rids):
            msg = self._recv(max(0.01, deadline - time.monotonic()))
            outs = msg.outputs if isinstance(msg, StepOutputs) else (msg,)
            for out in outs:
                assert isinstance(out, TokenOutput), out
                tokens[out.rid] += out.token_ids
                if out.finished:
                    final[out.rid] = out
        return [
            TokenOutput(
                **{
                    **{k: getattr(final[r], k) for k in final[r].__dataclass_fields__},
                    "token_ids": tuple(tokens[r]),
                }
            )
            for r in rids
        ]

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, timeout_s: float = 120
    ) -> list[TokenOutput]:
        """Send all prompts at once; returns each one's final output (all its tokens)."""
        rids = [self.send(prompt, sampling) for prompt in prompts]
        return self.collect(rids, timeout_s)

    def admin(self, op: str, timeout_s: float = 30, **options: Any) -> dict:
        """One admin call; `options` are further `AdminRequest` fields (tiers...)."""
        req_id = f"a{next(self._ids)}"
        self.send_sock.send(encode(AdminRequest(req_id, op, **options)))
        while True:
            msg = self._recv(timeout_s)
            if isinstance(msg, AdminReply) and msg.req_id == req_id:
                assert msg.ok, msg.error
                return msg.payload

    def wait_quiet(self, timeout_s: float = 60) -> dict:
        """Until no request is queued and no cache copy or storage ticket is pending."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.admin("stats")
            cache = stats["cache"]
            if (
                not any(stats["queues"].values())
                and cache["pending_transfers"] == 0
                and cache["pending_storage"] == 0
            ):
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not go quiet: {stats['queues']}, {cache}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.loop.stopping = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the engine loop did not stop"
        for sock in self._sockets:
            sock.close(linger=0)
        self.ctx.term()
