"""`asynchicache bench vllm`: time to first token under vLLM, with and without our tiers.

    asynchicache bench vllm [--model HF_DIR] [--prompt-tokens 1500] [--rounds 3]
        [--python .venv-vllm/bin/python] [--block-size N] [--threads N]
        [--out FILE.json] [--decode-clients 8] [--decode-tokens 256]

Starts the servers itself, one at a time, all with identical vLLM flags
(eager, float32, the same max-model-len and KV cache size), sends one warm-up
request to each after every start, then runs `--rounds` interleaved rounds of
four arms on a ~1,500-token chat prompt (streamed; TTFT = until the first
content token):

  vllm_cold        vLLM alone, a prompt it has never seen
  ours_restart     vLLM + AsynchicacheConnector, the prompt computed by the
                   previous process, then vLLM *and* its cache service restarted
  example_restart  the same with vLLM's ExampleConnector (safetensors on disk)
  ours_cold        vLLM + AsynchicacheConnector, a prompt never seen (overhead)

and a decode arm on the same servers (bench/vllm_decode.py): `--decode-clients`
clients (8) decoding `--decode-tokens` tokens (256) each at once, in tok/s,
vLLM alone (`vllm_decode`) and with our connector (`ours_decode`), whose saves
copy every page a request fills into L2 (`--decode-clients 0`: no decode arm).

Every arm computes on the same `--threads` (default: every core; vLLM's own
default differs with and without a connector, see bench/processes/vllm_process.py).
It reports the median of each arm, each arm's hit tokens (ours: our disk
tier counter; ExampleConnector: vLLM's external prefix cache hits), the
connector's decode cost (1 - ours_decode / vllm_decode) and the load average,
as JSON. The model defaults to the embedded SmolLM2 exported
with `asynchicache model export-hf`. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from asynchicache.bench.processes.vllm_process import VllmFlags, VllmServer, VllmThreads, metric_sum
from asynchicache.bench.vllm_decode import DecodeLoad, decode_tok_s
from asynchicache.bench.workloads.text import text
from asynchicache.storage.client.storage_client import StorageClient

ARMS = ("vllm_cold", "ours_restart", "example_restart", "ours_cold")
DECODE_ARMS = ("vllm_decode", "ours_decode")


@dataclass(frozen=True)
class BenchConfig:
    model: Path | None
    prompt_tokens: int = 1500
    rounds: int = 3
    python: str = sys.executable
    max_model_len: int = 4096
    kv_cache_bytes: int = 1 << 30
    work_dir: Path | None = None
    block_size: int | None = None  # vLLM's --block-size for every arm (None: its default)
    # vLLM's compute threads for every arm (None: every core; bench/processes/vllm_process.py's
    # VllmThreads): alone it reserves a core, with a connector two, so without one
    # setting the arms would compute on different thread counts.
    threads: int | None = None
    decode: DecodeLoad | None = field(default_factory=DecodeLoad)  # None: no decode arm
    # vLLM's --dtype for every arm; "auto" takes the checkpoint's (a bfloat16 one runs
    # CPU_ATTN's amx kernel on AMX hosts: `model export-hf --dtype bfloat16`)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.rounds <= 0 or self.prompt_tokens <= 0:
            raise ValueError("--rounds and --prompt-tokens must be positive")
        VllmThreads.of(self.threads)  # raises on a count outside [1, cores]

    def env(self) -> dict[str, str]:
        return VllmThreads.of(self.threads).env()


def messages(seed: int, approx_tokens: int) -> list[dict[str, str]]:
    """A chat prompt: an English-like document of about `approx_tokens` and a question."""
    document = text(random.Random(seed), max(approx_tokens - 30, 10))
    return [{"role": "user", "content": f"{document}\n\nSummarise the text above in one line."}]


def ttft(server: VllmServer, msgs: list[dict[str, str]]) -> float:
    """Seconds from sending the request to the first streamed content token."""
    body = {"model": "model", "messages": msgs, "max_tokens": 4, "temperature": 0.0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {})
            if delta.get("content"):
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


@dataclass
class Arm:
    """One server configuration (restarted between rounds for the restart arms)."""

    name: str
    flags: VllmFlags
    log: Path
    python: str
    hits: Callable[[VllmServer], float]
    env: dict[str, str] = field(default_factory=dict)
    server: VllmServer | None = None
    hit_tokens: list[float] = field(default_factory=list)

    def start(self) -> VllmServer:
        self.stop()
        self.server = VllmServer(self.flags, self.log, python=self.python, env=self.env)
        self.server.start()
        self.server.chat([{"role": "user", "content": "Say hello."}], max_tokens=2)  # warm-up
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        address = self.flags.extra_config.get("cache_service")
        if address and not _service_gone(address, 120):  # a restart restarts it too
            raise RuntimeError(f"the cache service at {address} outlived its vLLM")

    def timed(self, msgs: list[dict[str, str]]) -> float:
        assert self.server is not None
        before = self.hits(self.server)
        seconds = ttft(self.server, msgs)
        time.sleep(1.0)  # the step's stats reach /metrics
        self.hit_tokens.append(self.hits(self.server) - before)
        return seconds


def _service_gone(address: str, timeout_s: float) -> bool:
    """Wait until no cache service answers at `address` (ours exits once the last vLLM
    using it is gone, after its writes)."""
    client = StorageClient.connect(address)
    try:
        deadline = time.monotonic() + timeout_s
        while client.wait_ready(0.5):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True
    finally:
        client.close()


def _our_hits(server: VllmServer) -> float:
    metrics = server.metrics()
    return sum(
        metric_sum(metrics, "vllm:asynchicache_hit_tokens_total", tier=t)
        for t in ("host", "disk", "remote")
    )


def _external_hits(server: VllmServer) -> float:
    return metric_sum(server.metrics(), "vllm:external_prefix_cache_hits_total")


def _arms(config: BenchConfig, model: Path, work: Path) -> dict[str, Arm]:
    extra = () if config.block_size is None else ("--block-size", str(config.block_size))
    common: dict[str, Any] = {
        "max_model_len": config.max_model_len,
        "kv_cache_bytes": config.kv_cache_bytes,
        "dtype": config.dtype,
        "extra": extra,
    }
    ours = VllmFlags(
        model,
        connector="AsynchicacheConnector",
        extra_config={
            "disk_cache_dir": str(work / "ours-kv"),
            "cache_service": f"ipc://{work / 'run' / 'cache.sock'}",
            "lookup_timeout_s": 5.0,
            "prefetch_timeout_s": 30.0,
        },
        **common,
    )
    example = VllmFlags(
        model,
        connector="ExampleConnector",
        extra_config={"shared_storage_path": str(work / "example-kv")},
        **common,
    )
    plain = VllmFlags(model, **common)
    py, env = config.python, config.env()
    return {
        "vllm": Arm("vllm", plain, work / "vllm.log", py, _external_hits, env),
        "ours": Arm("ours", ours, work / "ours.log", py, _our_hits, env),
        "example": Arm("example", example, work / "example.log", py, _external_hits, env),
    }


def run(config: BenchConfig) -> dict:
    work = config.work_dir or Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = config.model or _export_default(work)
    arms = _arms(config, model, work)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    hits: dict[str, list[float]] = {arm: [] for arm in ARMS}
    rates: dict[str, list[float]] = {arm: [] for arm in DECODE_ARMS}
    load_before = os.getloadavg()[0]

    def timed(arm_name: str, arm: Arm, msgs: list[dict[str, str]]) -> None:
        times[arm_name].append(arm.timed(msgs))
        hits[arm_name].append(arm.hit_tokens[-1])

    def decoded(arm_name: str, arm: Arm, seed: int) -> None:
        if config.decode is not None and arm.server is not None:
            rates[arm_name].append(decode_tok_s(arm.server.url, config.decode, seed))

    try:
        # One server at a time (a vLLM takes ~2 GB), each started and warmed up
        # before it is timed, so every arm sees a fresh process.
        for r in range(config.rounds):
            seed = 1000 * (r + 1)
            computed = messages(seed, config.prompt_tokens)
            arms["vllm"].start()
            timed("vllm_cold", arms["vllm"], messages(seed + 1, config.prompt_tokens))
            decoded("vllm_decode", arms["vllm"], seed + 3)
            arms["vllm"].stop()
            for name in ("ours", "example"):  # computed by one process, timed in the next
                ttft(arms[name].start(), computed)
                arms[name].start()  # stops the first: vLLM and (ours) its cache service
                timed(f"{name}_restart", arms[name], computed)
                if name == "ours":
                    timed("ours_cold", arms[name], messages(seed + 2, config.prompt_tokens))
                    decoded("ours_decode", arms[name], seed + 4)
                arms[name].stop()
    finally:
        for arm in arms.values():
            arm.stop()
    return _report(config, times, hits, load_before, rates)


def _report(
    config: BenchConfig,
    times: dict[str, list[float]],
    hits: dict[str, list[float]],
    load_before: float,
    rates: dict[str, list[float]] | None = None,
) -> dict:
    med = {arm: statistics.median(ts) for arm, ts in times.items()}
    out: dict[str, Any] = {f"{arm}_ttft_s": round(med[arm], 4) for arm in ARMS}
    out.update(
        {
            "rounds": {arm: [round(t, 4) for t in ts] for arm, ts in times.items()},
            "hit_tokens": hits,
            "prompt_tokens_target": config.prompt_tokens,
            "block_size": config.block_size,
            "env": config.env(),
            "vllm_threads": VllmThreads.of(config.threads).describe(),
            "ours_restart_vs_vllm_cold": round(med["ours_restart"] / med["vllm_cold"], 4),
            "ours_restart_vs_example_restart": round(
                med["ours_restart"] / med["example_restart"], 4
            ),
            "ours_cold_vs_vllm_cold": round(med["ours_cold"] / med["vllm_cold"], 4),
            "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        }
    )
    out.update(_decode_report(config, rates or {}))
    return out


def _decode_report(config: BenchConfig, rates: dict[str, list[float]]) -> dict:
    """The decode arm's medians and the connector's cost (a share of vLLM's tok/s)."""
    if config.decode is None or not all(rates.get(arm) for arm in DECODE_ARMS):
        return {}
    med = {arm: statistics.median(rates[arm]) for arm in DECODE_ARMS}
    return {
        "vllm_decode_tok_s": round(med["vllm_decode"], 2),
        "ours_decode_tok_s": round(med["ours_decode"], 2),
        "decode_rounds": {arm: [round(r, 2) for r in rates[arm]] for arm in DECODE_ARMS},
        "decode_load": dataclasses.asdict(config.decode),
        "ours_decode_cost": round(1.0 - med["ours_decode"] / med["vllm_decode"], 4),
    }


def _export_default(work: Path) -> Path:
    from asynchicache.tools.export_hf import export_hf

    return export_hf(work / "smollm2-hf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asynchicache bench vllm", description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="HF folder (default: SmolLM2)")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--python",
        default=sys.executable,
        help="the Python with vLLM installed (e.g. .venv-vllm/bin/python)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="vLLM --block-size for all arms (CPU: a multiple of 32; default: vLLM's)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="vLLM's compute threads for every arm (sets VLLM_CPU_NUM_OF_RESERVED_CPU to "
        "cores - threads; default: every core)",
    )
    p.add_argument(
        "--decode-clients",
        type=int,
        default=DecodeLoad.clients,
        help="clients decoding at once in the decode arm (0: no decode arm)",
    )
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=DecodeLoad.max_tokens,
        help="tokens each decode client generates",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="vLLM's --dtype for every arm (auto: the checkpoint's; a bfloat16 one runs "
        "CPU_ATTN's amx kernel on AMX hosts)",
    )
    p.add_argument("--work-dir", type=Path, default=None, help="logs, disk caches (default: tmp)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    result = run(
        BenchConfig(
            a.model,
            a.prompt_tokens,
            a.rounds,
            a.python,
            work_dir=a.work_dir,
            block_size=a.block_size,
            threads=a.threads,
            decode=DecodeLoad(a.decode_clients, a.decode_tokens) if a.decode_clients else None,
            dtype=a.dtype,
        )
    )
    text_out = json.dumps(result, indent=2)
    print(text_out)
    if a.out is not None:
        a.out.write_text(text_out + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
