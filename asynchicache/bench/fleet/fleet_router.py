"""vllm-router (PyPI `vllm-router`, a Rust binary) in front of a fleet, as a child process.

`router_argv` writes the command line docs/fleet.md recommends: one `--kv-event-source`
(and `--kv-event-replay-source`) per instance, the block size = our page size, the
credits (`--kv-penalty-host/-disk/-external`, from `asynchicache fleet credits`), and
debug logging, whose `KV prefix decision` lines (`decisions()`) say which worker each
request went to and how many prompt tokens the router credited there.

What vllm-router 0.1.17 does with our events (found by running it; docs/fleet.md):
it asks each worker's `/v1/completions/render` (or the chat one) for the request's
token ids, hashes them per block (with `lora_name`), and walks the tree the workers'
`BlockStored` token ids built; medium "GPU" (or none, or any name it does not know)
counts 1.0, "CPU" `--kv-penalty-host`, "DISK"/"STORAGE" `--kv-penalty-disk`, and a
block with `ownership` `--kv-penalty-external`.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from asynchicache.bench.processes.server_process import BenchServer, free_port
from asynchicache.fleet.credits import Credits

POLICIES = ("round_robin", "cache_aware", "kv_aware", "power_of_two", "random")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DECISION = re.compile(
    r'KV prefix decision outcome="(?P<outcome>[^"]*)" worker="(?P<worker>[^"]*)" '
    r"input_tokens=(?P<input>\d+) new_prefill_tokens=(?P<new>\d+) "
    r"credited_prefix_tokens=(?P<credited>\d+)"
)


@dataclass(frozen=True)
class Worker:
    """One instance: its URL and its KV event sockets (tcp://, as vllm-router requires)."""

    url: str
    events: str | None = None
    replay: str | None = None


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "kv_aware"
    block_size: int = 16
    model: str = "asynchicache"  # vllm-router's model identity for static event sources
    credits: Credits | None = None  # None: its defaults
    log_level: str = "debug"  # the decisions are logged at debug
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown vllm-router policy {self.policy!r}; known: {POLICIES}")


@dataclass(frozen=True)
class Decision:
    worker: str
    input_tokens: int
    credited: int
    outcome: str


def router_binary() -> str:
    """The `vllm-router` next to this Python, else on PATH; FileNotFoundError otherwise."""
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.exists() else shutil.which("vllm-router")
    if found is None:
        raise FileNotFoundError("vllm-router is not installed: pip install vllm-router")
    return found


def router_argv(
    config: RouterConfig, workers: Sequence[Worker], metrics_port: int, port: str = "{port}"
) -> list[str]:
    argv = [
        router_binary(),
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--policy",
        config.policy,
        "--log-level",
        config.log_level,
        "--worker-urls",
        *[w.url for w in workers],
    ]
    if config.policy == "kv_aware":
        argv += ["--kv-event-block-size", str(config.block_size), "--kv-event-model", config.model]
        for w in workers:
            if w.events is not None:
                argv += ["--kv-event-source", f"{w.url}={w.events}"]
            if w.replay is not None:
                argv += ["--kv-event-replay-source", f"{w.url}={w.replay}"]
        if config.credits is not None:
            argv += config.credits.flags()
    # Its health checks every 60 s would mark a busy CPU worker down; the fleet's own
    # supervisor restarts instances.
    argv += ["--health-check-interval-secs", "3600", "--prometheus-port", str(metrics_port),
             *config.extra]  # fmt: skip
    return argv


class VllmRouter(BenchServer):
    """vllm-router on a free port, in front of `workers`; `decisions()` reads its log."""

    def __init__(
        self, config: RouterConfig, workers: Sequence[Worker], log_path: Path,
        startup_timeout_s: float = 60.0,
    ) -> None:  # fmt: skip
        argv = router_argv(config, workers, metrics_port=free_port())
        super().__init__([], log_path, startup_timeout_s, command=argv)
        self.config = config
        self.workers = list(workers)

    def decisions(self) -> list[Decision]:
        text = _ANSI.sub("", self.log_path.read_text(errors="replace"))
        return [
            Decision(m["worker"], int(m["input"]), int(m["credited"]), m["outcome"])
            for m in _DECISION.finditer(text)
        ]
