"""The engine's torch threads: every core but one by default, `--threads` otherwise."""

from __future__ import annotations

import subprocess
import sys

from asynchicache.engine.threads import available_cores, default_threads


def test_default_leaves_one_core_to_the_other_processes() -> None:
    assert [default_threads(n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]
    assert default_threads() == max(1, available_cores() - 1)


def test_set_threads_sets_torch_in_this_process_only() -> None:
    code = ("import torch; from asynchicache.engine.threads import set_threads, default_threads;"
            "a = set_threads(None); b = torch.get_num_threads(); c = set_threads(3);"
            "print(a == default_threads() == b, c == torch.get_num_threads() == 3)")
    # The affinity mask of the child decides its default: pin it to one core.
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["True", "True"]
