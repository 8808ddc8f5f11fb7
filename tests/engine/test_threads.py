"""The engine's torch threads: what the other processes leave free by default, `--threads`
otherwise."""

from __future__ import annotations

import subprocess
import sys

import torch

from asynchicache.engine.threads import (
    CpuSample,
    ThreadGovernor,
    available_cores,
    cpu_sample,
    default_threads,
    others_cores,
    threads_for,
)


def test_default_leaves_one_core_to_the_other_processes() -> None:
    assert [default_threads(n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert default_threads() == max(1, available_cores() - 1)


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
    assert [threads_for(2, x) for x in (0.0, 0.2, 0.3, 1.0, 1.3, 5.0)] == [2, 2, 1, 1, 1, 1]
    assert [threads_for(8, x) for x in (0.1, 0.9, 2.2)] == [8, 7, 6]


def test_others_cores_subtracts_our_own_cpu() -> None:
    before = CpuSample(at=10.0, busy_s=100.0, own_s=40.0)
    after = CpuSample(at=12.0, busy_s=103.0, own_s=42.5)  # 3 s busy, 2.5 s of them ours
    assert others_cores(before, after, 2) == 0.25
    assert others_cores(before, CpuSample(12.0, 120.0, 40.0), 2) == 2.0  # at most the machine
    sample = cpu_sample()
    assert sample is not None and sample.busy_s > 0 and sample.own_s > 0


def test_the_governor_changes_threads_after_two_samples_agree() -> None:
    before = torch.get_num_threads()
    try:
        gov = ThreadGovernor(cores=2, sample_every_s=0.0)
        assert gov.threads == 1  # it starts at cores - 1
        assert gov._propose(2) is None  # one sample asking for 2 is not enough
        assert gov._propose(2) == 2 and torch.get_num_threads() == 2
        assert gov._propose(1) is None and gov._propose(2) is None  # a burst, then quiet
        assert gov.threads == 2 and gov.changes == 1
        assert gov.poll() in (None, 1, 2)  # a real sample: whatever the machine says
        fixed = ThreadGovernor(fixed=1, cores=2, sample_every_s=0.0)
        assert fixed.poll() is None and fixed.threads == 1
    finally:
        torch.set_num_threads(before)
