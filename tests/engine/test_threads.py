"""The engine's torch threads: what the other processes leave free by default, `--threads`
otherwise."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.threads import (
    ARITHMETIC_BOUND_TOKENS,
    CpuSample,
    ThreadGovernor,
    available_cores,
    cpu_sample,
    default_threads,
    others_cores,
    threads_for,
)
from asynchicache.model.loader import LoadedModel
from asynchicache.settings.config import CacheConfig, EngineConfig


def test_default_starts_at_every_core() -> None:
    assert [default_threads(n) for n in (1, 2, 4, 16)] == [1, 2, 4, 16]
    assert default_threads() == available_cores()


def test_the_governor_sets_torch_in_this_process_only() -> None:
    code = (
        "import torch; from asynchicache.engine.threads import ThreadGovernor, default_threads;"
        "a = ThreadGovernor().apply(); b = torch.get_num_threads();"
        "c = ThreadGovernor(3).apply();"
        "print(a == default_threads() == b, c == torch.get_num_threads() == 3)"
    )
    # The affinity mask of the child decides its default: pin it to one core.
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split() == ["True", "True"]


def test_threads_leave_what_the_others_use() -> None:
    assert [threads_for(2, x) for x in (0.0, 0.2, 0.45, 0.6, 1.3, 5.0)] == [2, 2, 2, 1, 1, 1]
    assert [threads_for(8, x) for x in (0.1, 0.9, 2.2)] == [8, 7, 6]


def test_others_cores_subtracts_our_own_cpu() -> None:
    before = CpuSample(at=10.0, busy_s=100.0, own_s=40.0)
    after = CpuSample(at=12.0, busy_s=103.0, own_s=42.5)  # 3 s busy, 2.5 s of them ours
    assert others_cores(before, after, 2) == 0.25
    assert others_cores(before, CpuSample(12.0, 120.0, 40.0), 2) == 2.0  # at most the machine
    sample = cpu_sample()
    assert sample is not None and sample.busy_s > 0 and sample.own_s > 0


class Machine:
    """A fake /proc/stat and clock: advance it by what other processes and we use."""

    def __init__(self) -> None:
        self.at = 100.0
        self.busy_s = 0.0
        self.own_s = 0.0

    def run(self, seconds: float, others: float, own: float = 0.0) -> None:
        """`seconds` pass with `others` cores busy elsewhere and `own` in this process."""
        self.at += seconds
        self.busy_s += seconds * (others + own)
        self.own_s += seconds * own

    def sample(self) -> CpuSample:
        return CpuSample(self.at, self.busy_s, self.own_s)

    def clock(self) -> float:
        return self.at


@pytest.fixture
def machine() -> Iterator[Machine]:
    before = torch.get_num_threads()  # the governor applies its count to torch
    yield Machine()
    torch.set_num_threads(before)


def governor(machine: Machine, cores: int = 2) -> ThreadGovernor:
    return ThreadGovernor(cores=cores, sampler=machine.sample, clock=machine.clock,
                          machine_cores=cores)  # fmt: skip


def idle_for(gov: ThreadGovernor, machine: Machine, seconds: float, others: float) -> list[int]:
    """The idle loop's polls every 5 ms; returns the counts it switched to."""
    changes = []
    for _ in range(round(seconds / 0.005)):
        machine.run(0.005, others)
        if (n := gov.poll(idle=True)) is not None:
            changes.append(n)
    return changes


def idle_at_every_core(machine: Machine) -> ThreadGovernor:
    """A governor that sampled a quiet machine while idle: at every core (2)."""
    gov = governor(machine)
    idle_for(gov, machine, 1.1, others=0.0)
    assert gov.threads == 2
    return gov


def test_a_rise_seen_idle_is_taken_at_once_any_other_change_after_two_samples(
    machine: Machine,
) -> None:
    gov = governor(machine)
    assert gov.threads == 2  # it starts at every core
    assert gov._propose(1) is None and gov._propose(1) == 1  # a fall: two samples agree
    assert gov._propose(2) == 2  # a rise seen idle: at once
    assert gov._propose(1) is None and gov._propose(2) is None  # a burst, then quiet
    assert gov.threads == 2 and gov.changes == 2
    assert gov._propose(1) is None and gov._propose(1) == 1  # a fall again
    gov._last_idle = False  # the last sample was taken under load
    assert gov._propose(2) is None and gov._propose(2) == 2  # a rise there: two as well
    assert ThreadGovernor().poll() in (None, 1, 2)  # a real sample: whatever the machine says
    fixed = ThreadGovernor(fixed=1, cores=2, sample_every_s=0.0)
    assert fixed.poll() is None and fixed.threads == 1
    assert [fixed.for_step(n) for n in (1, 4096)] == [1, 1]  # every step on the fixed count


def test_start_up_is_not_measured(machine: Machine) -> None:
    gov = governor(machine)
    machine.run(8.0, others=1.5)  # the HTTP process and the service start while the model loads
    gov.start()  # engine ready
    assert idle_for(gov, machine, 2.0, others=0.05) == [] and not gov.settling
    assert gov.threads == 2  # a sample of start-up's load would have proposed one


def test_a_cold_prompt_right_after_start_up_is_computed_whole_on_every_core(
    machine: Machine,
) -> None:
    """Starting at cores - 1 cut it into 256-token steps on one thread until a sample
    raised the count (a 1,557-token prompt: 1.77-1.80 s against 1.22-1.31 s whole)."""
    gov = governor(machine)
    gov.apply()
    gov.start()  # engine ready; the request comes before the first idle sample
    idle_for(gov, machine, 0.1, others=0.0)
    assert prefill(gov, machine, tokens=1557, chunk=2048, others=0.0) == [(1557, 2)]
    # An idle machine's first samples do not take it off every core either.
    idle_for(gov, machine, 1.0, others=0.0)
    assert gov.threads == 2 and gov.changes == 0


def test_a_burst_while_idle_does_not_flip_the_count(machine: Machine) -> None:
    gov = idle_at_every_core(machine)
    # A client busy for one sample's span, then quiet again: proposed, not taken.
    assert idle_for(gov, machine, 0.5, others=1.0) == [] and gov.settling
    assert idle_for(gov, machine, 2.0, others=0.0) == [] and gov.threads == 2
    # Busy for longer: the engine leaves it its core.
    assert idle_for(gov, machine, 1.0, others=1.0) == [1]


def prefill(gov: ThreadGovernor, machine: Machine, tokens: int, chunk: int,
            others: float) -> list[tuple[int, int]]:  # fmt: skip
    """A prompt computed chunk by chunk as `EngineLoop.run` does, 339 tok/s per thread
    (measured: 339 at 1 thread, 677 at 2); returns (tokens, threads) of each step."""
    steps = []
    gov.poll(idle=False)  # the request arrived
    while tokens:
        n = min(tokens, chunk)
        threads = gov.for_step(n)
        machine.run(n / (339 * threads), others, own=threads)
        steps.append((n, threads))
        tokens -= n
        gov.poll(idle=False)
    return steps


def decode(gov: ThreadGovernor, machine: Machine, steps: int, others: float) -> list[int]:
    """Batch-8 decode steps (60 ms on 2 threads, 73 on 1); returns each step's threads."""
    seen = []
    gov.poll(idle=False)
    for _ in range(steps):
        threads = gov.for_step(8)
        machine.run(0.060 if threads == 2 else 0.073, others, own=threads)
        seen.append(threads)
        gov.poll(idle=False)
    return seen


def test_prompts_run_on_every_core_whatever_the_others_do(machine: Machine) -> None:
    """A 1,024-token step was no slower on 2 threads than on 1 beside a busy core, and
    faster beside two (bench/micro/contention.py); the governor used to leave prompts that came
    while a client was busy on one thread (1.5-1.8x their time in a pressure run)."""
    gov = governor(machine)
    idle_for(gov, machine, 10.0, others=1.0)  # a busy machine: small steps on one thread
    assert gov.threads == 1
    assert prefill(gov, machine, tokens=2048, chunk=2048, others=1.0) == [(2048, 2)]
    assert prefill(gov, machine, tokens=1557, chunk=512, others=2.0) == [
        (512, 2), (512, 2), (512, 2), (21, 1)]  # fmt: skip
    assert torch.get_num_threads() == 1  # the last step's count is torch's
    assert gov.for_step(ARITHMETIC_BOUND_TOKENS) == 2
    assert gov.for_step(ARITHMETIC_BOUND_TOKENS - 1) == 1


def test_the_count_of_small_steps_follows_the_others(machine: Machine) -> None:
    gov = idle_at_every_core(machine)
    assert decode(gov, machine, 20, others=0.3) == [2] * 20  # the HTTP process streaming
    # Others take both cores mid-way: within a 2 s sample and a 0.5 s confirmation.
    seen = decode(gov, machine, 100, others=2.0)
    at_two = seen.count(2) * 0.060
    assert seen == sorted(seen, reverse=True) and 1.0 <= at_two <= 2.5 + 0.2, seen
    assert gov.threads == 1 and gov.changes == 1
    # Quiet again: back to every core within two samples (a rise under load waits for one).
    assert decode(gov, machine, 100, others=0.0)[-1] == 2 and gov.changes == 2


def test_the_engine_sets_each_steps_threads_before_its_forward(
    tiny_llama: LoadedModel,
) -> None:
    """A whole cache hit computes one token; its decode steps one each; a prompt all of it."""
    seen: list[tuple[int, int]] = []  # (new tokens, steps run before this forward)
    engine: Engine | None = None

    def record(new_tokens: int) -> None:
        assert engine is not None
        seen.append((new_tokens, engine.steps))

    cache = CacheConfig(disk_cache_dir=None)
    config = EngineConfig(prompt_logits_mib=0)  # the whole hit computes its last token
    engine = Engine(config, cache, loaded=tiny_llama, step_threads=record)
    page = cache.page_size
    try:
        prompt = list(range(3, 3 + 3 * page))  # three whole pages
        sampling = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        engine.generate([prompt], sampling)
        engine.generate([prompt], sampling)  # the prompt is cached: its last token, then 2 decodes
    finally:
        engine.close()
    assert [n for n, _ in seen] == [3 * page, 1, 1, 1, 1, 1]
    assert [s for _, s in seen] == list(range(6))  # once per step, before the step ends
