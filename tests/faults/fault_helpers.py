"""Shared machinery of the fault, fuzz and security tests: a live `asynchicache serve`,
a steady load whose greedy answers are known, prompts, metrics, and the fault record.

Scale: `FAULTS_SCALE=ci` (default, a few minutes for the whole matrix) or `full`
(scripts/faults-full.sh); every knob can also be set alone, e.g.
`FAULTS_SERVICE_KILLS=30`. With `FAULTS_REPORT=path.jsonl` each scenario appends
its figures there (the full script turns them into a table); with
`FAULTS_KEEP_DIR=path` the chaos test leaves its disk folder there.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from asynchicache.engine.tokenizer import Tokenizer
from asynchicache.server.frontend import load_frontend
from asynchicache.storage.disk_admin import verify_folder
from asynchicache.storage.header import decode_header, peek_header_len
from asynchicache.storage.shm import remove_stale_segments

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 6
PAGE_SIZE = 16
ROLES = ("engine", "cache-service")

_CI = {
    "service_kills": 3,
    "kill_gap_s": 4,
    "corruptions": 10,
    "prompts": 16,
    "clients": 3,
    "heavy_prompts": 9,
    "disk_full_prompts": 6,
    "redis_prompts": 4,
    "phase_s": 5,
    "chaos_pauses": 10,  # per target (the cache service, then redis-server)
    "chaos_pause_max_ms": 2000,  # pauses last 1 s to this
    "chaos_prompts": 6,
    "chaos_restart": 0,  # ask every prompt again after a restart (hits from disk/Redis)
    "chaos_sample": 0,  # pages deep-verified afterwards (0: every page)
}
_FULL = {
    "service_kills": 20,
    "kill_gap_s": 12,  # > the supervisor's stable_s: each kill is a fresh crash, not a loop
    "corruptions": 60,
    "prompts": 32,
    "clients": 4,
    "heavy_prompts": 40,
    "disk_full_prompts": 30,
    "redis_prompts": 16,
    "phase_s": 30,
    "chaos_pauses": 40,
    "chaos_pause_max_ms": 3000,
    "chaos_prompts": 16,
    "chaos_restart": 1,
    "chaos_sample": 0,
}


def scale() -> str:
    return os.environ.get("FAULTS_SCALE", "ci")


def knob(name: str) -> int:
    """A fault-matrix size: `FAULTS_<NAME>` if set, else the value for the current scale."""
    env = os.environ.get(f"FAULTS_{name.upper()}")
    if env is not None:
        return int(env)
    return (_FULL if scale() == "full" else _CI)[name]


# --------------------------------------------------------------------------- prompts

_WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
          "juniper", "kestrel", "lagoon", "mosaic", "nectar", "orchid", "pepper")  # fmt: skip


@dataclass(frozen=True)
class Prompt:
    """A prompt sent as token ids, so the test knows exactly which pages it makes."""

    name: str
    ids: tuple[int, ...]

    @property
    def pages(self) -> list[tuple[int, ...]]:
        n = len(self.ids) // PAGE_SIZE
        return [self.ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] for i in range(n)]


def tokenizer() -> Tokenizer:
    return load_frontend(None).tokenizer


def make_prompts(tok: Tokenizer, tag: str, n: int, lines: int = 14) -> list[Prompt]:
    """`n` prompts of about 10 pages whose first page already differs (no page shared)."""
    out = []
    for k in range(n):
        rng = random.Random(f"{tag}-{k}")
        body = " ".join(
            f"[{tag}{k}.{j}] {rng.choice(_WORDS)} {rng.randint(10, 999)}." for j in range(lines)
        )
        text = f"Ledger {tag}{k}: {body} The next entry is"
        out.append(Prompt(f"{tag}{k}", tuple(tok.encode(text, add_special_tokens=False))))
    return out


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Answer:
    text: str
    cached: dict[str, int]  # cached prompt tokens by tier


class RequestFailed(Exception):
    """The server did not answer a request completely (what a load counts as failed)."""


def complete(client: httpx.Client, prompt: Prompt, stream: bool, salt: str | None = None) -> Answer:
    """A greedy /v1/completions of `prompt`; raises RequestFailed on anything incomplete."""
    body: dict[str, object] = {
        "prompt": list(prompt.ids),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if salt is not None:
        body["cache_salt"] = salt
    try:
        if stream:
            return _streamed(client, body)
        r = client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        raise RequestFailed(f"{type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise RequestFailed(f"HTTP {r.status_code}: {r.text[:300]}")
    data = r.json()
    choice = data["choices"][0]
    if choice.get("finish_reason") not in ("stop", "length"):
        raise RequestFailed(f"finish_reason {choice.get('finish_reason')!r}")
    return Answer(choice["text"], _tiers(data["usage"]))


def _streamed(client: httpx.Client, body: dict[str, object]) -> Answer:
    text, usage, reason, done = "", None, None, False
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RequestFailed(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RequestFailed(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                text += choice.get("text") or ""
                reason = choice.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
    if not done or usage is None or reason not in ("stop", "length"):
        raise RequestFailed(f"incomplete stream (done={done}, reason={reason!r})")
    return Answer(text, _tiers(usage))


def _tiers(usage: dict) -> dict[str, int]:
    return dict(usage["prompt_tokens_details"].get("cached_tokens_by_tier") or {})


def references(url: str, prompts: Sequence[Prompt], clients: int) -> dict[str, str]:
    """Greedy answers of prompts that share no page with anything cached, each asked once."""
    out: dict[str, str] = {}
    lock = threading.Lock()
    todo = list(prompts)

    def work() -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    p = todo.pop()
                # No other prompt shares a page with it, so this is a cold answer (a request
                # preempted for L1 room may report its own pages as cached on re-admission).
                answer = complete(client, p, stream=False)
                with lock:
                    out[p.name] = answer.text

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == len(prompts), "a reference request failed"
    return out


@dataclass
class LoadResult:
    served: int = 0
    failed: int = 0
    wrong: int = 0
    failures: list[str] = field(default_factory=list)
    tiers: dict[str, int] = field(default_factory=dict)  # cached tokens summed by tier

    def add_tiers(self, cached: dict[str, int]) -> None:
        for tier, n in cached.items():
            self.tiers[tier] = self.tiers.get(tier, 0) + n


class Load:
    """`clients` threads asking greedy completions of known prompts until stopped.

    Half the requests stream. Every answer is compared with its reference; a
    request that errors, is cut short or answers differently is counted.
    """

    def __init__(
        self, url: str, prompts: Sequence[Prompt], expected: dict[str, str], clients: int
    ) -> None:
        self.url = url
        self.prompts = list(prompts)
        self.expected = expected
        self.result = LoadResult()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(clients)
        ]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        self._stop.set()
        for t in self._threads:
            t.join(300)
        return self.result

    def snapshot(self) -> tuple[int, int, int]:
        with self._lock:
            return self.result.served, self.result.failed, self.result.wrong

    def _work(self, index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(base_url=self.url, timeout=300) as client:
            while not self._stop.is_set():
                prompt = rng.choice(self.prompts)
                self._one(client, prompt, stream=rng.random() < 0.5)

    def _one(self, client: httpx.Client, prompt: Prompt, stream: bool) -> None:
        try:
            answer = complete(client, prompt, stream)
        except RequestFailed as exc:
            with self._lock:
                self.result.failed += 1
                self.result.failures.append(f"{prompt.name}: {exc}")
            return
        with self._lock:
            self.result.served += 1
            self.result.add_tiers(answer.cached)
            if answer.text != self.expected[prompt.name]:
                self.result.wrong += 1
                self.result.failures.append(
                    f"{prompt.name}: {answer.text!r} != {self.expected[prompt.name]!r} "
                    f"(cached {answer.cached})"
                )


def ask_all(
    url: str, prompts: Iterable[Prompt], expected: dict[str, str], clients: int = 3
) -> LoadResult:
    """Every prompt once (concurrently), checked against its reference."""
    load = Load(url, [], expected, 0)
    todo = list(prompts)
    lock = threading.Lock()

    def work() -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    p = todo.pop()
                load._one(client, p, stream=False)

    threads = [threading.Thread(target=work) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return load.result


# --------------------------------------------------------------------------- server


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def children_of(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class LiveServer:
    """`python -m asynchicache serve` as a subprocess on a free port, the way users run it.

    Small tiers by default (L1 1,024 tokens, L2 0.1 GB), so a rotating set of
    prompts keeps reading from and writing to the disk tier.
    """

    def __init__(
        self, disk_dir: Path | None, log_path: Path, *extra: str, api_key: str | None = None
    ) -> None:
        self.disk_dir = disk_dir
        self.log_path = log_path
        self.api_key = api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        disk = ["--disk-cache-dir", str(disk_dir)] if disk_dir else ["--no-disk-cache"]
        self.argv = [
            sys.executable, "-m", "asynchicache", "serve", "--port", str(self.port),
            "--device", "cpu", *disk, "--device-cache-tokens", "1024",
            "--host-cache-gb", "0.1", "--log-level", "info", *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout_s: float = 300.0) -> LiveServer:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        if self.api_key:
            env["ASYNCHICACHE_API_KEY"] = self.api_key
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy in {timeout_s}s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def pids(self) -> dict[str, int]:
        """role -> pid of the live children (by process title)."""
        out = {}
        for pid in children_of(self.pid):
            title = proc_title(pid)
            for role in ROLES:
                if title == f"asynchicache: {role}":
                    out[role] = pid
        return out

    def wait_role(self, role: str, not_pid: int | None, timeout_s: float = 60.0) -> int:
        """The pid of `role` once one other than `not_pid` runs."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid = self.pids().get(role)
            if pid is not None and pid != not_pid:
                return pid
            time.sleep(0.1)
        raise AssertionError(f"no new {role} within {timeout_s}s:\n{self.log_tail()}")

    def client(self, timeout: float = 300.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout, headers=self.headers)

    def stats(self, integrity: bool = False) -> dict:
        r = httpx.get(
            self.url + "/cache/stats",
            params={"integrity": "true"} if integrity else None,
            headers=self.headers,
            timeout=30,
        )
        r.raise_for_status()
        return r.json()

    def metrics(self) -> dict[str, float]:
        """The /metrics samples: 'name{labels}' -> value."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=30).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def kill_all(self) -> list[int]:
        """kill -9 of every process of the server at once (frozen first: nobody cleans up)."""
        pids = [*self.pids().values(), self.pid]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(30)
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        return pids

    def shutdown(self) -> int | None:
        """SIGTERM and wait (SIGKILL if it hangs); the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        children = list(self.pids().values())
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.kill_all()
            code = None
        deadline = time.monotonic() + 30
        while any(alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        remove_stale_segments()  # a segment of a killed engine (kill_all paths)
        return code

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """One sample of `metrics()`; 0 when absent (a counter not yet exported)."""
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return samples.get(key, 0.0)


def corrupt_detected(server: LiveServer) -> float:
    name = "asynchicache_storage_corrupt_pages_detected_total"
    return metric(server.metrics(), name, tier="disk")


@dataclass
class Matrix:
    """The server under test (replaced when a test restarts it) and what it must answer."""

    root: Path
    tok: Tokenizer
    server: LiveServer
    prompts: list[Prompt]
    expected: dict[str, str]

    @property
    def disk(self) -> Path:
        assert self.server.disk_dir is not None
        return self.server.disk_dir


# --------------------------------------------------------------------------- disk files


def page_files(disk_dir: Path) -> list[Path]:
    return sorted(p for p in disk_dir.rglob("*.kv") if not p.name.startswith("."))


def temp_files(disk_dir: Path) -> list[Path]:
    return sorted(disk_dir.rglob(".tmp-*"))


def page_tokens(path: Path) -> tuple[int, ...] | None:
    """The token ids a page file's header names (None when the header does not parse)."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
        return decode_header(head[: peek_header_len(head)]).tokens
    except (OSError, ValueError):
        return None


def files_by_prompt(disk_dir: Path, prompts: Sequence[Prompt]) -> dict[str, list[Path]]:
    """prompt name -> its page files on disk (pages are matched by their token ids)."""
    owner = {}
    for p in prompts:
        for i, page in enumerate(p.pages):
            owner[(i, page)] = p.name
    by_tokens: dict[tuple[int, ...], list[str]] = {}
    for (_, page), name in owner.items():
        by_tokens.setdefault(page, []).append(name)
    out: dict[str, list[Path]] = {p.name: [] for p in prompts}
    for path in page_files(disk_dir):
        tokens = page_tokens(path)
        names = by_tokens.get(tokens or ())
        if names and len(names) == 1:  # a page only one prompt has
            out[names[0]].append(path)
    return out


def verify_disk(disk_dir: Path) -> int:
    """Bad page files under real names (checked the way a reader checks them; not removed)."""
    report = verify_folder(disk_dir, remove=False)
    return report.bad


# --------------------------------------------------------------------------- the record


@dataclass
class FaultRecord:
    """One row of the fault matrix (docs/reliability.md)."""

    scenario: str
    faults_injected: int
    requests_served: int
    requests_failed: int
    wrong_outputs: int
    corrupt_detected: int | None = None  # None: not a corruption scenario
    corrupt_served: int | None = None
    seconds: float = 0.0
    notes: dict[str, object] = field(default_factory=dict)


def record(rec: FaultRecord) -> None:
    """Print the row (pytest -s shows it) and append it to $FAULTS_REPORT when set."""
    row = {"scale": scale(), **asdict(rec)}
    print("\nFAULT", json.dumps(row))
    path = os.environ.get("FAULTS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
