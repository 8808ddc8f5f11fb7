"""A stand-in engine process speaking the real wire protocol, for HTTP-layer tests.

    python tests/server/fake_engine.py <run_dir>

It binds the same IPC sockets as `engine.process.run_engine` and "generates"
by echoing the prompt's tokens back one per step, then an end-of-sequence
token. Behaviour the tests steer:

* `seed == SLOW_SEED` makes a request emit a token only every `SLOW_DELAY_S`.
* every aborted request id is appended to `<run_dir>/aborts.txt`.
* `cached.device` is the longest page-aligned prefix shared with an earlier prompt.
* a group of `n` members: each member echoes the same tokens; member i's token
  logprob is `-(i + 1) / 10` (so member 0 is the most likely), its alternatives
  are the next token ids; prompt logprobs likewise, on member 0's first output.
* `max_tokens` 0 answers with the prompt logprobs alone.
* `pin` of more than `PIN_LIMIT_TOKENS` tokens is refused with code "over_limit".
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from asynchicache.engine.protocol import (
    AbortRequest,
    AdminReply,
    AdminRequest,
    CachedTokens,
    GenerateRequest,
    StepOutputs,
    TokenLogprob,
    TokenOutput,
    decode,
    encode,
)

PAGE = 16
EOS = 2
SLOW_SEED = 424242
SLOW_DELAY_S = 0.2
FAST_DELAY_S = 0.002
PIN_LIMIT_TOKENS = 128  # a longer pin is refused as over the limit (HTTP 409)


@dataclass
class _Job:
    req: GenerateRequest
    cached: CachedTokens
    index: int = 0
    emitted: int = 0
    next_at: float = field(default_factory=time.monotonic)

    @property
    def delay(self) -> float:
        return SLOW_DELAY_S if self.req.sampling.seed == SLOW_SEED else FAST_DELAY_S


def _lp(token: int, index: int, top: int) -> TokenLogprob:
    alternatives = tuple((token + k + 1) % 1000 for k in range(top))
    return TokenLogprob(token, -(index + 1) / 10, alternatives, tuple(-1.0 - k for k in range(top)))


class FakeEngine:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.jobs: dict[tuple[str, int], _Job] = {}
        self.seen: list[tuple[int, ...]] = []
        self.hit_tokens = 0
        ctx = zmq.Context()
        self.pull = ctx.socket(zmq.PULL)
        self.pull.bind(f"ipc://{run_dir / 'engine-in'}")
        self.push = ctx.socket(zmq.PUSH)
        self.push.bind(f"ipc://{run_dir / 'engine-out'}")

    def _cached(self, prompt: tuple[int, ...]) -> int:
        best = 0
        for old in self.seen:
            n = 0
            for a, b in zip(old, prompt, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1) // PAGE * PAGE

    def handle(self, msg: object) -> None:
        if isinstance(msg, GenerateRequest):
            cached = CachedTokens(device=self._cached(msg.prompt_token_ids))
            self.hit_tokens += cached.device
            self.seen.append(msg.prompt_token_ids)
            for i in range(msg.n):
                self.jobs[(msg.rid, i)] = _Job(msg, cached, i)
        elif isinstance(msg, AbortRequest):
            with (self.run_dir / "aborts.txt").open("a") as f:
                f.write(msg.rid + "\n")
            for key in [k for k in self.jobs if k[0] == msg.rid]:
                if msg.index is None or key[1] == msg.index:
                    self._send(self._out(self.jobs.pop(key), (), "abort"))
        elif isinstance(msg, AdminRequest):
            if msg.op == "pin" and len(msg.token_ids) > PIN_LIMIT_TOKENS:
                reply = AdminReply(msg.req_id, False, {"code": "over_limit"}, "over the limit")
                self._send(reply)
                return
            self._send(AdminReply(msg.req_id, True, self.admin(msg)))

    def admin(self, msg: AdminRequest) -> dict:
        if msg.op == "health":
            return {"ok": True, "model": "fake-model"}
        if msg.op == "stats":  # shaped like Engine.stats(): CacheStats.to_dict() and queues
            pages = sum(len(p) // PAGE for p in self.seen)
            counters = {
                "match_tokens": sum(len(p) for p in self.seen),
                "device_hit_tokens": self.hit_tokens,
                "host_hit_tokens": 0,
                "storage_hit_tokens": 0,
                "device_to_host_pages": pages,
                "device_to_host_bytes": pages * 4096,
                "store_failures": 0,
                "writes_skipped": 0,
            }
            return {
                "cache": {
                    "counters": counters,
                    "device": {
                        "total": 64,
                        "free": 64 - pages % 64,
                        "cached": pages % 64,
                        "in_use": 0,
                    },
                    "host": None,
                    "page_bytes": 4096,
                    "pending_transfers": 0,
                    "pending_storage": 0,
                },
                "queues": {"waiting": 0, "loading": 0, "running": len(self.jobs)},
                "preemptions": 0,
            }
        if msg.op == "lookup":
            return {"device": self._cached(msg.token_ids), "host": 0, "disk": 0, "remote": 0}
        if msg.op == "clear":
            n, self.seen = len(self.seen), []
            owner = hashlib.sha256(msg.cache_salt.encode()).hexdigest()[
                :32
            ]  # the engine's is keyed
            return {
                "cleared": n,
                "scope": list(msg.tiers),
                "owner": owner if msg.cache_salt else None,
            }
        if msg.op == "pin":
            return {"pin_id": "0" * 32, "pages": len(msg.token_ids) // PAGE, "ttl_s": msg.ttl_s}
        if msg.op == "unpin":
            return {"pin_ids": list(msg.pin_ids), "removed": len(msg.pin_ids)}
        raise ValueError(msg.op)

    def _out(self, job: _Job, tokens: tuple[int, ...], reason: str | None) -> TokenOutput:
        n = len(job.req.prompt_token_ids)
        sp = job.req.sampling
        logprobs = (
            () if sp.logprobs is None else tuple(_lp(t, job.index, sp.logprobs) for t in tokens)
        )
        prompt_lps: tuple[TokenLogprob, ...] = ()
        if sp.prompt_logprobs is not None and job.index == 0 and job.emitted <= 1:
            prompt_lps = tuple(_lp(t, 0, sp.prompt_logprobs) for t in job.req.prompt_token_ids[1:])
        cumulative = -(job.index + 1) / 10 * job.emitted if sp.logprobs is not None else 0.0
        return TokenOutput(
            job.req.rid,
            tokens,
            reason is not None,
            reason,
            n,
            job.emitted,
            job.cached,
            index=job.index,
            logprobs=logprobs,
            prompt_logprobs=prompt_lps,
            cumulative_logprob=cumulative,
        )

    def step(self) -> None:
        """Every output of a step in one `StepOutputs`, as the real engine sends them."""
        outputs: list[TokenOutput] = []
        now = time.monotonic()
        for key, job in list(self.jobs.items()):
            if now < job.next_at:
                continue
            job.next_at = now + job.delay
            if job.req.sampling.max_tokens == 0:
                outputs.append(self._out(job, (), "length"))
                del self.jobs[key]
                continue
            prompt = job.req.prompt_token_ids
            token = prompt[job.emitted] if job.emitted < len(prompt) else EOS
            job.emitted += 1
            reason = None
            if token == EOS:
                reason = "stop"
            elif job.emitted >= job.req.sampling.max_tokens:
                reason = "length"
            outputs.append(self._out(job, (token,), reason))
            if reason is not None:
                del self.jobs[key]
        if outputs:
            self._send(StepOutputs(tuple(outputs)))

    def _send(self, msg: object) -> None:
        self.push.send(encode(msg))

    def run(self) -> None:
        while True:
            if self.pull.poll(1 if self.jobs else 50):
                while True:
                    try:
                        raw = self.pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(decode(raw))
            self.step()


if __name__ == "__main__":
    FakeEngine(Path(sys.argv[1])).run()
