"""The native paged attention kernel (model/native.py) against plain attention.

The reference gathers each sequence's K/V by its page table and computes
softmax(q k^T / sqrt(d)) v in float64, causal from each row's position (and
within a sliding window). The kernel reads the pool in place: page
boundaries, page sizes that are not a multiple of its 16-key chunks, several
sequences in one call, decode rows next to prefill chunks, grouped-query
attention, query rows that are views of a wider projection, and threads that
split the work (Python's or an OpenMP team) must all give the reference's numbers within
float32 noise.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import pytest
import torch

from asynchicache.model import native
from asynchicache.model.native import KernelWork, PagedAttentionKernel


@pytest.fixture(scope="module", params=native.runnable_isas())
def kernel(request: pytest.FixtureRequest) -> PagedAttentionKernel:
    """Every build this CPU runs (on an AVX-512 host, the AVX2 one too)."""
    made = native.load(request.param)
    assert made is not None, "this machine has a C compiler: the kernel must build"
    return made


def reference(pool_k, pool_v, q, tables, items, window: int) -> torch.Tensor:
    """Plain attention in float64, one row at a time."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads, hd = q.shape[1], q.shape[2]
    kv_heads = pool_k.shape[2]
    group = heads // kv_heads
    for offset, row0, rows, pos0 in items.tolist():
        n_pages = -(-(pos0 + rows) // pool_k.shape[1])
        table = tables[offset : offset + n_pages]
        k = pool_k[table].flatten(0, 1).double()  # [keys, kv_heads, hd]
        v = pool_v[table].flatten(0, 1).double()
        for r in range(rows):
            pos = pos0 + r
            lo = max(0, pos - window + 1) if window else 0
            for h in range(heads):
                kh = k[lo : pos + 1, h // group]  # [keys, hd]
                scores = kh @ q[row0 + r, h].double() / math.sqrt(hd)
                out[row0 + r, h] = torch.softmax(scores, 0) @ v[lo : pos + 1, h // group]
    return out


def make_case(
    seed: int, page: int, heads: int, kv_heads: int, hd: int, seqs: list[tuple[int, int]]
):
    """A pool with scattered pages and one item per (first position, rows) sequence."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-(p + r) // page) for p, r in seqs) + 5
    # The layer's views of a page-first pool [pages, layers, 2, page, kv_heads, hd], layer 1.
    pool = torch.randn(n_pages, 3, 2, page, kv_heads, hd, generator=g)
    order = torch.randperm(n_pages, generator=g).tolist()
    tables, items, row = [], [], 0
    for pos0, rows in seqs:
        need = -(-(pos0 + rows) // page)
        items.append([len(tables), row, rows, pos0])
        tables += [order.pop() for _ in range(need)]
        row += rows
    wide = torch.randn(row, heads + 2 * kv_heads, hd, generator=g)  # a fused projection
    q = wide[:, :heads]  # rows heads x hd apart... plus the K/V heads: a strided view
    return pool[:, 1, 0], pool[:, 1, 1], q, torch.tensor(tables), torch.tensor(items)


CASES = {
    "decode rows, GQA 3": (16, 9, 3, 64, [(1040 - 1, 1), (37, 1), (0, 1)]),
    "prefill from 0 over many pages": (16, 9, 3, 64, [(0, 70)]),
    "prefill after a cached prefix, mid-page": (16, 4, 2, 32, [(29, 40)]),
    "mixed: chunks and decodes": (16, 8, 2, 16, [(0, 23), (12, 18), (18, 1), (40, 1)]),
    "pages of 8 (half a chunk)": (8, 4, 4, 64, [(5, 30), (0, 1)]),
    "pages of 20 (a chunk and a part)": (20, 6, 1, 128, [(3, 50), (61, 1)]),
    "group of 7 query heads": (16, 7, 1, 64, [(10, 60)]),
    "head_dim 48 (an odd count of 16-dim chunks), odd tiles": (16, 4, 2, 48, [(0, 9), (3, 44)]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [0, 13])
def test_the_kernel_matches_plain_attention(
    kernel: PagedAttentionKernel, case: str, window: int
) -> None:
    page, heads, kv_heads, hd, seqs = CASES[case]
    k, v, q, tables, items = make_case(7, page, heads, kv_heads, hd, seqs)
    rows = [r for _, r in seqs]
    tasks = KernelWork.count_tasks(rows, kv_heads, heads // kv_heads)
    work = KernelWork(tables, items, 1 / math.sqrt(hd), tasks)
    out = torch.empty(q.shape)
    kernel(k, v, q, out, work, window)
    expected = reference(k, v, q, tables, items, window)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6)
    # Threads split a call's tasks: the same numbers, bit for bit.
    split = torch.full(q.shape, float("nan"))
    for part in range(3):
        kernel(k, v, q, split, work, window, part, 3)
    assert torch.equal(split, out)
    # ... and so does an OpenMP team (torch's threads, kernels/team.c).
    assert kernel.team, "gcc has OpenMP and torch's libgomp is the process's only runtime"
    team = torch.full(q.shape, float("nan"))
    kernel(k, v, q, team, work, window, threads=3)
    assert torch.equal(team, out)


def test_shapes_it_cannot_take_go_to_torch(kernel: PagedAttentionKernel) -> None:
    cpu = torch.device("cpu")
    assert native.supports(torch.float32, cpu, 64, 3)
    assert not native.supports(torch.bfloat16, cpu, 64, 3)
    assert not native.supports(torch.float32, cpu, 24, 3)  # not a multiple of 16
    assert not native.supports(torch.float32, torch.device("meta"), 64, 3)
    k, v, q, tables, items = make_case(1, 16, 4, 2, 64, [(0, 4)])
    work = KernelWork(tables, items, 0.125, 2)
    with pytest.raises(ValueError, match="unsupported"):
        kernel(k[..., :24], v[..., :24], q[..., :24], torch.empty(4, 4, 24), work, 0)


def test_the_build_is_cached_by_source_and_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cc = native._compiler()
    assert cc is not None
    first = native._build(cc, tmp_path)
    assert native._build(cc, tmp_path) == first  # built once
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DANOTHER"))
    assert native._build(cc, tmp_path) != first  # other flags: another library
    for isa in native.runnable_isas():  # each build its own library
        assert native._build(cc, tmp_path, native.ISAS[isa]).name.startswith(f"kernels-{isa}-")


def test_a_compiler_without_openmp_builds_the_kernels_without_a_team(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where -fopenmp fails the library is built without it; its calls then run on one
    thread each (`team_of` False: Python threads share them, as before the teams)."""
    cc = native._compiler()
    assert cc is not None
    monkeypatch.setattr(native, "OPENMP_FLAGS", ("-fno-such-openmp-flag",))
    lib = ctypes.CDLL(str(native._build(cc, tmp_path)))
    assert not native.team_of(lib)


def test_an_openmp_build_that_does_not_load_is_built_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host with a compiler but no OpenMP runtime to load keeps the native kernels."""
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path))
    real = ctypes.CDLL

    def no_runtime(path: str) -> ctypes.CDLL:
        if native._build(native._compiler() or "cc", tmp_path) == Path(path):
            raise OSError("libgomp.so.1: cannot open shared object file")
        return real(path)

    monkeypatch.setattr(native.ctypes, "CDLL", no_runtime)
    kernel = native._load.__wrapped__(native.chosen_isa())
    assert kernel is not None and not kernel.team
