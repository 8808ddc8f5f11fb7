"""The engine process's allocator settings (launch/allocator.py): freed activations stay
in the heap, so a forward's next layer does not fault its blocks in again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asynchicache.launch.allocator import ALLOCATOR_KEEP, allocator_env

# Blocks of a forward's sizes (19, 9.5, 3.5 MB...) taken and given back layer after layer;
# prints the page faults of the rounds after the first (the first maps the heap in).
LAYERS = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
sizes = [19 << 20, 9 << 20, 3 << 20, 6 << 20, 9 << 20]
def layer():
    held = []
    for n in sizes:
        p = libc.malloc(n)
        ctypes.memset(p, 1, n)
        held.append(p)
        if len(held) > 2:
            libc.free(held.pop(0))
    for p in held:
        libc.free(p)
layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env: dict[str, str]) -> int:
    done = subprocess.run([sys.executable, "-c", LAYERS], env=env, capture_output=True,
                          text=True, check=True, timeout=60)  # fmt: skip
    return int(done.stdout)


def test_freed_blocks_are_reused_without_new_page_faults() -> None:
    base = {k: v for k, v in os.environ.items() if k not in dict(ALLOCATOR_KEEP)}
    kept = _faults(base | dict(allocator_env({})))
    default = _faults(base)
    one_layer_pages = (19 + 9 + 3 + 6 + 9) * 256  # the blocks' 4 KiB pages, once
    assert kept < one_layer_pages // 10, f"{kept} page faults in 10 layers after the first"
    assert default > kept  # glibc's default gives blocks back and faults them in again


HUGE = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
n = 64 << 20
p = libc.malloc(n)
ctypes.memset(p, 1, n)
rollup = open("/proc/self/smaps_rollup").read()
print(int(rollup.split("AnonHugePages:")[1].split()[0]))
"""


def test_large_blocks_get_huge_pages_where_the_kernel_lends_them() -> None:
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this kernel lends no transparent huge pages")
    base = {k: v for k, v in os.environ.items() if k not in dict(ALLOCATOR_KEEP)}
    done = subprocess.run([sys.executable, "-c", HUGE], env=base | dict(allocator_env({})),
                          capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    assert int(done.stdout) >= 32 << 10, f"{done.stdout.strip()} kB of huge pages for 64 MiB"


def test_an_operators_allocator_setting_is_kept() -> None:
    assert allocator_env({}) == ALLOCATOR_KEEP
    assert allocator_env({"MALLOC_ARENA_MAX": "2"}) == ()
    assert allocator_env({"LD_PRELOAD": "libtcmalloc.so"}) == ()
