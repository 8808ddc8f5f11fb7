"""The servers `bench compare` starts: ours, vLLM's CPU build, and any `--peer-cmd`.

A peer is a command line with placeholders, so the exact command of every
server is recorded next to its figures:

    {port}   a free TCP port on 127.0.0.1 (the peer must listen there)
    {model}  the Hugging Face folder every server serves
    {name}   the model name clients send (`--served-model-name`)
    {disk}   a folder that lives for one round and survives the restart (a disk cache)

Every peer must answer `GET /v1/models` once it is ready and serve streamed
`/v1/chat/completions` with `stream_options.include_usage` and `ignore_eos`.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from asynchicache.bench.processes.server_process import BenchServer
from asynchicache.bench.processes.vllm_process import VllmThreads

SERVED_NAME = "smollm2"  # the `model` every request names


@dataclass(frozen=True)
class Peer:
    """One server under comparison: a name and its command template."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if not self.name or "=" in self.name:
            raise ValueError(f"peer name {self.name!r}: give NAME=COMMAND, NAME without '='")
        if not any("{port}" in a for a in self.argv):
            raise ValueError(f"peer {self.name}: the command has no {{port}} to listen on")

    def command(self, model: Path, disk: Path) -> list[str]:
        """The argv with {model}, {name} and {disk} filled in ({port} stays for the launcher)."""
        values = {"{model}": str(model), "{name}": SERVED_NAME, "{disk}": str(disk)}
        out = []
        for arg in self.argv:
            for key, value in values.items():
                arg = arg.replace(key, value)
            out.append(arg)
        return out

    def shell(self) -> str:
        return shlex.join(self.argv)

    def server(
        self, model: Path, disk: Path, log_path: Path, startup_timeout_s: float
    ) -> BenchServer:
        """This peer as a server to start (ready once `GET /v1/models` answers)."""
        command = self.command(model, disk)
        return BenchServer(
            [], log_path, startup_timeout_s, self.env, command, ready_path="/v1/models"
        )


# Every peer is an OpenAI server: where it listens and the model it serves, by name.
_SERVED_AS = (
    "--host",
    "127.0.0.1",
    "--port",
    "{port}",
    "--model",
    "{model}",
    "--served-model-name",
    "{name}",
)


def ours(extra: Sequence[str] = ()) -> Peer:
    """`asynchicache serve` with its defaults (disk tier on a per-round folder)."""
    argv = (
        sys.executable,
        "-m",
        "asynchicache",
        "serve",
        *_SERVED_AS,
        "--disk-cache-dir",
        "{disk}",
        *extra,
    )
    return Peer("ours", argv)


def vllm(
    python: Path, kv_cache_bytes: int, extra: Sequence[str] = (), threads: VllmThreads | None = None
) -> Peer:
    """vLLM's OpenAI server, CPU build, float32, prefix caching on, default compilation,
    computing on `threads` (default: every core; `VllmThreads`).

    On CPU vLLM reserves `--gpu-memory-utilization` (0.9) of all memory by
    default and refuses to start when less is free; `--kv-cache-memory-bytes`
    gives it instead the KV memory our L1 has (`--device-cache-tokens`).
    """
    argv = (
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *_SERVED_AS,
        "--dtype",
        "float32",
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        *extra,
    )
    # Its usage statistics would try to reach the internet.
    env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **(threads or VllmThreads.of()).env()}
    return Peer("vllm", argv, MappingProxyType(env))


def parse_peer(spec: str) -> Peer:
    """`NAME=COMMAND` (a shell-quoted command line with the placeholders above)."""
    name, sep, command = spec.partition("=")
    if not sep or not command.strip():
        raise ValueError(f"--peer-cmd {spec!r}: expected NAME=COMMAND")
    return Peer(name.strip(), tuple(shlex.split(command)))
