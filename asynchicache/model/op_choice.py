"""Which implementation runs each op of a forward, per shape class: ours (the native
kernels) or torch's.

Where a native kernel loses to torch's op on this host and build, the engine takes
torch's, so that ours is never the slower one (`bench kernels` shows where: on the
Sapphire Rapids host the AVX2 build's whole-prompt attention and SiLU * up lost to torch
at 1,557 rows while its decode attention won ~6x). The choice is measured once at
start-up (`measure`: each op at a prefill shape and a decode shape, both arms taking
turns, best of a few rounds, within MEASURE_BUDGET_S; then `settle`: whole prefills of
FORWARD_TOKENS with that choice against torch's ops for every prefill pair, which sees
what ops timed alone miss, our kernels' threads and torch's OpenMP threads sharing the
cores; the warm-up's budget lacks what both took), recorded beside the kernel build so
that later starts (and other servers of the host) take the same choice, and applied per
forward by its rows (`shape_class`: PREFILL_MIN_ROWS or more rows are a prefill).
`python -m asynchicache.tools.op_choice_cli` measures anew and replaces the record
(run it on a quiet machine: a first start on busy cores records noise).

Invariants:
- Torch takes an (op, class) only when faster by more than MARGIN: a near tie keeps ours,
  so that noise does not flip the choice (and with it the pages' names) between starts.
- One choice per host (its cores), build and model shape: the first measurement is
  recorded (never overwritten by an engine; only the operator's command replaces it) and
  read back by every later process.
- The choice changes the KV's last bits, so it is part of the page names: `version(base)`
  folds it into the namespace's numerics version; the all-native choice gives `base`
  itself (pages computed before the choice existed keep their names and stay valid), and
  `from_version` reads a version back into its base and choice (the audit recomputes
  pages with the choice that computed them).
- The attention's class is the whole forward's (one kernel call per layer covers the
  batch); a row op's is its tensor's rows, which are the forward's rows.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from asynchicache.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedAttention,
    PrefillSpan,
)
from asynchicache.model.model_config import ModelConfig
from asynchicache.model.native import KernelThreads, KernelWork
from asynchicache.model.row_ops import NativeRowOps, RowOps

log = logging.getLogger(__name__)

OPS = ("attention", "rms_norm", "add_rms_norm", "silu_mul", "rotary", "scatter")
CLASSES = ("prefill", "decode")
PAIRS = tuple((op, cls) for op in OPS for cls in CLASSES)  # bit i of a version: PAIRS[i]
PREFILL_PAIRS = frozenset(pair for pair in PAIRS if pair[1] == "prefill")
PREFILL_MIN_ROWS = 64  # a forward of this many rows or more is a prefill
MARGIN = 0.05  # torch must be this much faster (relative) to be chosen
# The same for whole prefills (`settle`): a forward's time is steadier than one op's, and
# a loss this small is systematic there (SmolLM2, 128 tokens, Sapphire Rapids, load ~1.8:
# ours 3.9% slower on the AVX2 build, 2.6% on the AVX-512 one; 1,557 tokens, quiet:
# 13% and 3%, docs/benchmarks.md).
SETTLE_MARGIN = 0.02
MEASURE_BUDGET_S = 0.8
MAX_ROUNDS = 9  # of the measurement (a tiny model's rounds take microseconds)
FORWARD_TOKENS = 128  # of the whole prefills `settle` compares (~0.2 s on an AVX2 build)
FORWARD_ROUNDS = 3
SETTLE_BUDGET_S = 1.2  # of `settle`'s rounds (at least one is counted, after a warm-up)
PREFILL_PROBE_ROWS = 1024  # rows of the prefill shape measured
DECODE_PROBE_ROWS = 8  # sequences of the decode shape, each over PREFILL_PROBE_ROWS keys
PAGE_SIZE = 16
# Where choices are recorded (default: beside the kernel build). Tests point it at a fresh
# folder: a choice measured on cores busy with a test run would name a server's pages later.
RECORD_DIR_ENV = "ASYNCHICACHE_OP_CHOICE_DIR"
# A version with a choice in it: this flag, the base version << 12, the torch pairs' bits.
_CHOSEN_FLAG = 1 << 16


@dataclass(frozen=True)
class Timing:
    """One (op, class) measured: each arm's best seconds, and the share of rounds in which
    torch's call was the faster of the two run back to back (a load spike that slows one
    call of a round moves the best of neither arm much, and this share by one round)."""

    native_s: float
    torch_s: float
    torch_wins: float = 1.0


@dataclass(frozen=True)
class OpChoice:
    """The (op, class) pairs that run torch's op; every other pair runs ours."""

    torch_pairs: frozenset[tuple[str, str]] = frozenset()
    prefill_rows: int = PREFILL_MIN_ROWS

    def __post_init__(self) -> None:
        unknown = sorted(self.torch_pairs - set(PAIRS))
        if unknown:
            raise ValueError(f"OpChoice: unknown (op, class) pairs {unknown}; known: {PAIRS}")
        if self.prefill_rows < 2:
            raise ValueError(f"OpChoice: prefill_rows must be >= 2, got {self.prefill_rows}")

    def shape_class(self, rows: int) -> str:
        return "prefill" if rows >= self.prefill_rows else "decode"

    def native(self, op: str, rows: int) -> bool:
        """Whether ours runs `op` on a forward (or tensor) of `rows` rows."""
        return (op, self.shape_class(rows)) not in self.torch_pairs

    @property
    def all_native(self) -> bool:
        return not self.torch_pairs

    def version(self, base: int) -> int:
        """The numerics version of pages computed by the native build of version `base`
        with this choice (`base` itself when all is native)."""
        if self.all_native:
            return base
        if not 0 < base < 16:
            raise ValueError(f"OpChoice.version: base {base} outside [1, 16)")
        bits = sum(1 << i for i, pair in enumerate(PAIRS) if pair in self.torch_pairs)
        return _CHOSEN_FLAG | base << 12 | bits

    @staticmethod
    def from_version(version: int) -> tuple[int, OpChoice]:
        """(base version, choice) of a numerics version (`version`'s inverse)."""
        if not version & _CHOSEN_FLAG or version >> 17:
            return version, OpChoice()
        bits = version & 0xFFF
        pairs = frozenset(pair for i, pair in enumerate(PAIRS) if bits >> i & 1)
        return version >> 12 & 0xF, OpChoice(pairs)

    def table(self) -> dict[str, dict[str, str]]:
        """{op: {class: "native" or "torch"}} (bench engine's JSON, the log)."""
        return {
            op: {c: "torch" if (op, c) in self.torch_pairs else "native" for c in CLASSES}
            for op in OPS
        }

    def __str__(self) -> str:
        if self.all_native:
            return "native everywhere"
        return "torch for " + ", ".join(
            f"{op}/{c}" for op, c in PAIRS if (op, c) in self.torch_pairs
        )


def choose(timings: Mapping[tuple[str, str], Timing], margin: float = MARGIN) -> OpChoice:
    """Torch's op for every pair whose torch time beats ours by more than `margin`, in most
    rounds too."""
    return OpChoice(
        frozenset(
            pair
            for pair, t in timings.items()
            if t.torch_s * (1 + margin) < t.native_s and t.torch_wins > 0.5
        )
    )


def measure(
    threads: KernelThreads, config: ModelConfig, budget_s: float = MEASURE_BUDGET_S
) -> dict[tuple[str, str], Timing]:
    """Best seconds of every (op, class) in both arms at this model's widths: rounds of
    every call taking turns until `budget_s` is spent (at least two rounds: the first
    warms up and is not counted)."""
    probe = _Probe(config, threads)
    calls = {
        (op, cls): probe.calls(op, PREFILL_PROBE_ROWS if cls == "prefill" else DECODE_PROBE_ROWS)
        for op, cls in PAIRS
    }
    best = {pair: [math.inf, math.inf] for pair in PAIRS}
    wins = dict.fromkeys(PAIRS, 0)
    deadline = time.monotonic() + budget_s
    rounds = 0
    with torch.inference_mode():
        while rounds < 2 or (rounds < MAX_ROUNDS and time.monotonic() < deadline):
            for pair, arms in calls.items():
                took = []
                for call in arms if rounds % 2 else arms[::-1]:  # each arm first in turn
                    began = time.perf_counter()
                    call()
                    took.append(time.perf_counter() - began)
                native_s, torch_s = took if rounds % 2 else took[::-1]
                if rounds:
                    best[pair] = [min(best[pair][0], native_s), min(best[pair][1], torch_s)]
                    wins[pair] += torch_s < native_s
            rounds += 1
    return {pair: Timing(best[pair][0], best[pair][1], wins[pair] / (rounds - 1)) for pair in PAIRS}


def settle(
    choice: OpChoice,
    prefill: Callable[[OpChoice], float],
    rounds: int = FORWARD_ROUNDS,
    budget_s: float = SETTLE_BUDGET_S,
) -> OpChoice:
    """`choice`, or torch's ops for every prefill pair where a whole prefill with those is
    faster by SETTLE_MARGIN (best of `rounds` after a warm-up, in most rounds too). Ops timed
    alone miss what they do to each other: our kernels' threads and torch's OpenMP
    threads share the cores, and a forward alternates between them. `prefill(choice)`:
    seconds of one prefill forward computed with `choice`. Rounds only while `budget_s`
    lasts (a host too slow for one counted round keeps `choice`)."""
    alternative = OpChoice(choice.torch_pairs | PREFILL_PAIRS, choice.prefill_rows)
    if alternative == choice:
        return choice
    best, wins, counted = [math.inf, math.inf], 0, 0
    deadline = time.monotonic() + budget_s
    for round_ in range(rounds + 1):
        if time.monotonic() > deadline:  # a slow host: no more rounds (none counted: keep)
            break
        order = (0, 1) if round_ % 2 else (1, 0)
        took = {i: prefill((choice, alternative)[i]) for i in order}
        if round_:
            best = [min(best[0], took[0]), min(best[1], took[1])]
            wins += took[1] < took[0]
            counted += 1
    rounds = counted
    faster = rounds > 0 and best[1] * (1 + SETTLE_MARGIN) < best[0] and wins * 2 > rounds
    log.info("op choice, whole prefills: %.1f ms with %s, %.1f ms with torch's ops for "
             "prefills (faster in %d of %d rounds)", best[0] * 1e3, choice, best[1] * 1e3,
             wins, rounds)  # fmt: skip
    return alternative if faster else choice


def measured_choice(
    threads: KernelThreads,
    config: ModelConfig,
    budget_s: float = MEASURE_BUDGET_S,
    prefill: Callable[[OpChoice], float] | None = None,
) -> OpChoice:
    """This host's choice for this build and model shape: the one recorded
    beside the build (`_record`) where there is one, else `choose(measure(...))`, recorded
    there (the first process's stands: every server of a host names its pages alike)."""
    record = record_path(threads, config)
    try:
        choice = _decode(json.loads(record.read_text()))
        log.info("op choice (%s build, %s): %s", threads.kernel.isa, record.name, choice)
        return choice
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return remeasure(threads, config, budget_s, prefill, replace=False)


def remeasure(
    threads: KernelThreads,
    config: ModelConfig,
    budget_s: float,
    prefill: Callable[[OpChoice], float] | None,
    replace: bool,
) -> OpChoice:
    """Measure (per op, then whole prefills where `prefill` is given: `settle`) and record
    the choice; `replace`: over an existing record (an operator's `python -m
    asynchicache.tools.op_choice_cli` on a quiet machine), else the record another
    process wrote meanwhile wins."""
    record = record_path(threads, config)
    timings = measure(threads, config, budget_s)
    choice = choose(timings)
    if prefill is not None:
        choice = settle(choice, prefill)
    shown = {f"{op}/{c}": f"{t.native_s * 1e3:.3f}/{t.torch_s * 1e3:.3f}/{t.torch_wins:.2f}"
             for (op, c), t in timings.items()}  # fmt: skip
    log.info("op choice (%s build), measured: %s; ms ours/torch/torch's share of wins %s",
             threads.kernel.isa, choice, shown)  # fmt: skip
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".choice-", dir=record.parent)
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump({"torch": sorted(map(list, choice.torch_pairs)), "ms": shown}, f)
        try:
            if replace:
                os.replace(tmp, record)
            else:
                os.link(tmp, record)  # never replaces another process's record
        except FileExistsError:
            choice = _decode(json.loads(record.read_text()))
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as exc:
        log.warning("op choice not recorded at %s (%s)", record, exc)
    return choice


def record_path(threads: KernelThreads, config: ModelConfig) -> Path:
    """Where this build's choice for this model shape and host is kept."""
    c = config
    shape = (c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim)
    # The cores this process may use, not the thread count of the moment (which follows the
    # load: a record per load would name pages by the load at start-up).
    cores = len(os.sched_getaffinity(0))
    rule = (PREFILL_MIN_ROWS, MARGIN, SETTLE_MARGIN, FORWARD_TOKENS)
    key = f"{shape}{cores}{torch.__version__}{rule}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    library = threads.kernel.library
    folder = Path(os.environ.get(RECORD_DIR_ENV) or library.parent)
    return folder / f"{library.stem}.choice-{digest}.json"


def _decode(data: dict[str, list[list[str]]]) -> OpChoice:
    return OpChoice(frozenset((str(op), str(c)) for op, c in data["torch"]))


class _Probe:
    """Random data of a model's widths, and each op's call in both arms at a row count."""

    def __init__(self, config: ModelConfig, threads: KernelThreads) -> None:
        g = torch.Generator().manual_seed(0)
        c, t = config, PREFILL_PROBE_ROWS
        self.config = c
        self.arms: tuple[RowOps, RowOps] = (NativeRowOps(threads), RowOps())
        self.threads = threads
        self.x = torch.randn(t, c.hidden_size, generator=g)
        self.delta = torch.randn(t, c.hidden_size, generator=g)
        self.weight = 1 + 0.1 * torch.randn(c.hidden_size, generator=g)
        self.gate_up = torch.randn(t, 2 * c.intermediate_size, generator=g)
        self.qkv = torch.randn(t, c.q_size + 2 * c.kv_size, generator=g)
        angles = torch.randn(t, 1, c.head_dim // 2, generator=g)
        self.cos, self.sin = angles.cos(), angles.sin()
        pages = -(-t // PAGE_SIZE)
        self.pool = torch.zeros(pages, 1, 2, PAGE_SIZE, c.num_kv_heads, c.head_dim)

    def calls(self, op: str, rows: int) -> tuple[Callable[[], object], ...]:
        """(ours, torch's) calls of `op` on `rows` rows."""
        c, n = self.config, rows
        qk = c.num_heads + c.num_kv_heads
        x, delta, gate_up = self.x[:n], self.delta[:n].clone(), self.gate_up[:n]
        rot = self.qkv[:n, : qk * c.head_dim].view(n, qk, c.head_dim)
        v = self.qkv[:n, qk * c.head_dim :].view(n, c.num_kv_heads, c.head_dim)
        slots = torch.arange(n)
        residual = x.clone()  # added to in place by add_rms_norm, as a layer does
        made: list[Callable[[], object]] = []
        for native, ops in zip((True, False), self.arms, strict=True):
            by_op: dict[str, Callable[[], object]] = {
                "rms_norm": functools.partial(ops.rms_norm, x, self.weight, 1e-5),
                "add_rms_norm": functools.partial(
                    ops.add_rms_norm, residual, delta, self.weight, 1e-5
                ),
                "silu_mul": functools.partial(ops.silu_mul, gate_up),
                "rotary": functools.partial(ops.rotary_, rot, self.cos[:n], self.sin[:n]),
                "scatter": functools.partial(
                    ops.scatter_, self.pool[:, 0, 1], v, slots // PAGE_SIZE, slots % PAGE_SIZE
                ),
                "attention": functools.partial(self._attend, n, ops, native),
            }
            made.append(by_op[op])
        return tuple(made)

    def _attend(self, rows: int, ops: RowOps, native: bool) -> torch.Tensor:
        """One layer's attention: a prompt of `rows` rows (a prefill), or else (few rows)
        that many sequences' new tokens, each over the whole probe's keys (a decode)."""
        c, t, n = self.config, PREFILL_PROBE_ROWS, rows
        q = self.qkv[:n, : c.q_size].view(n, c.num_heads, c.head_dim)
        k = self.qkv[:n, c.q_size : c.q_size + c.kv_size].view(n, c.num_kv_heads, c.head_dim)
        v = self.qkv[:n, c.q_size + c.kv_size :].view(n, c.num_kv_heads, c.head_dim)
        pages = self.pool.shape[0]
        table = torch.arange(pages)
        group = c.num_heads // c.num_kv_heads
        scale = 1 / math.sqrt(c.head_dim)
        if n >= PREFILL_MIN_ROWS:  # a whole prompt of n rows
            slots = torch.arange(n)
            items, counts = [[0, 0, n, 0]], [n]
            span = PrefillSpan(0, n, 0, table)
            meta = AttentionMetadata(slots // PAGE_SIZE, slots % PAGE_SIZE, prefills=(span,))
        else:  # n sequences at the probe's last position (its slot rewritten: same keys)
            last = torch.full((n,), t - 1)
            items, counts = [[0, i, 1, t - 1] for i in range(n)], [1] * n
            dec = DecodeGroup(torch.arange(n), table.repeat(n), torch.full((n,), t), pages, True)
            meta = AttentionMetadata(last // PAGE_SIZE, last % PAGE_SIZE, decodes=(dec,))
        kernel = None
        if native:
            tasks = KernelWork.count_tasks(counts, c.num_kv_heads, group)
            work = KernelWork(table, torch.tensor(items), scale, tasks)
            meta = AttentionMetadata(meta.write_pages, meta.write_offsets, kernel_work=work)
            kernel = self.threads
        return PagedAttention(self.pool, meta, (None,), kernel, ops).attend(0, q, k, v)


class ChosenRowOps(RowOps):
    """The row steps, each in ours or torch's as `choice` says for its tensor's rows."""

    def __init__(self, native: NativeRowOps, choice: OpChoice) -> None:
        self.native_ops = native
        self.choice = choice

    def _ops(self, op: str, rows: int) -> RowOps:
        return self.native_ops if self.choice.native(op, rows) else RowOps()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._ops("rms_norm", x.shape[0]).rms_norm(x, weight, eps)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        ops = self._ops("add_rms_norm", residual.shape[0])
        return ops.add_rms_norm(residual, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ops("silu_mul", gate_up.shape[0]).silu_mul(gate_up)

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._ops("rotary", x.shape[0]).rotary_(x, cos, sin)

    def scatter_(
        self, pool: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        self._ops("scatter", rows.shape[0]).scatter_(pool, rows, pages, offsets)
