"""The native row kernels (model/row_ops.py, kernels/row_ops.c) against torch's.

Each step (RMSNorm, residual add + RMSNorm, SiLU * up, rotary, the K/V copy into pages)
must give torch's numbers within float32 noise at widths that are and are not a multiple
of the kernels' 16 lanes, on row views of wider tensors, and when threads split the rows
(torch's OpenMP team or Python threads: bitwise the numbers of one thread); what the kernels
do not take (another dtype, a non-contiguous row) goes to torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from asynchicache.model import native
from asynchicache.model.native import KernelThreads
from asynchicache.model.row_ops import MIN_PART_FLOATS, NativeRowOps, RowOps

TORCH = RowOps()


@pytest.fixture(
    scope="module",
    params=[(isa, team) for isa in native.runnable_isas() for team in (True, False)],
    ids=lambda p: f"{p[0]}-{'team' if p[1] else 'python-threads'}",
)
def ops(request: pytest.FixtureRequest) -> Iterator[NativeRowOps]:
    """Every build this CPU runs (on an AVX-512 host, the AVX2 one too), its calls shared
    by torch's OpenMP threads (the library's team) and by Python threads."""
    isa, team = request.param
    kernel = native.load(isa)
    assert kernel is not None, "this machine has a C compiler: the kernels must build"
    assert kernel.team, "gcc has OpenMP and torch's libgomp is the process's only runtime"
    with ThreadPoolExecutor(1) as workers:
        previous = torch.get_num_threads()
        torch.set_num_threads(2)  # two parts where a call is long enough
        if team:
            yield NativeRowOps(KernelThreads(kernel))
        else:
            yield NativeRowOps(KernelThreads(dataclasses.replace(kernel, team=False), workers))
        torch.set_num_threads(previous)


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def rows(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n,width", [(3, 64), (5, 37), (600, 576), (1, 15)])
def test_rms_norm_and_the_residual_add_match_torch(ops: NativeRowOps, n: int, width: int) -> None:
    x, delta = rows(n, width, 1) * 3, rows(n, width, 2)
    weight = 1 + 0.1 * rows(1, width, 3)[0]
    close(ops.rms_norm(x, weight, 1e-6), TORCH.rms_norm(x, weight, 1e-6))
    ours_res, ref_res = x.clone(), x.clone()
    ours = ops.add_rms_norm(ours_res, delta, weight, 1e-5)
    ref = TORCH.add_rms_norm(ref_res, delta, weight, 1e-5)
    assert torch.equal(ours_res, ref_res)  # the residual stream: an exact float add
    close(ours, ref)


@pytest.mark.parametrize("n,inter", [(4, 48), (700, 1536), (2, 21)])
def test_silu_times_up_matches_torch(ops: NativeRowOps, n: int, inter: int) -> None:
    gate_up = rows(n, 2 * inter, 4) * 6  # gates far into both tails of the sigmoid
    gate_up[0, 0], gate_up[0, 1] = -100.0, 100.0  # exp(-x) past float32's range
    close(ops.silu_mul(gate_up), TORCH.silu_mul(gate_up))


@pytest.mark.parametrize("heads,hd", [(12, 64), (6, 32), (3, 24)])
def test_rotary_in_place_on_a_view_of_the_projection(
    ops: NativeRowOps, heads: int, hd: int
) -> None:
    n = 300
    wide = rows(n, (heads + 2) * hd, 5)  # q and k heads, then v: rotate a view of the first
    angles = torch.arange(n)[:, None] * (1.0 / 10000 ** (torch.arange(hd // 2) / (hd // 2)))
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [T, 1, hd / 2]
    ours, ref = wide.clone(), wide.clone()
    ops.rotary_(ours[:, : heads * hd].view(n, heads, hd), cos, sin)
    TORCH.rotary_(ref[:, : heads * hd].view(n, heads, hd), cos, sin)
    close(ours, ref)
    assert torch.equal(ours[:, heads * hd :], wide[:, heads * hd :])  # v untouched


def test_new_rows_land_in_their_pages_and_slots(ops: NativeRowOps) -> None:
    pool = torch.zeros(9, 4, 2, 8, 3, 16)  # [pages, layers, 2, page, kv_heads, hd]
    k = rows(700, 3 * 16, 6).view(700, 3, 16)
    pages = torch.randint(0, 9, (700,), generator=torch.Generator().manual_seed(7))
    offsets = torch.randint(0, 8, (700,), generator=torch.Generator().manual_seed(8))
    keep = {}  # a slot written twice keeps its last row in both ways
    for t, (p, o) in enumerate(zip(pages.tolist(), offsets.tolist(), strict=True)):
        keep[(p, o)] = t
    order = torch.tensor(sorted(keep.values()))
    expected = pool.clone()
    TORCH.scatter_(expected[:, 2, 1], k[order], pages[order], offsets[order])
    ops.scatter_(pool[:, 2, 1], k[order], pages[order], offsets[order])
    assert torch.equal(pool, expected)


def test_long_calls_are_split_between_threads(ops: NativeRowOps) -> None:
    seen: list[tuple[int, int, int]] = []
    x = rows(1000, 96, 9)
    ops._rows(x, lambda r0, r1, t: seen.append((r0, r1, t)))
    assert x.numel() >= 2 * MIN_PART_FLOATS
    if ops.threads.kernel.team:  # one call, its rows cut by the C side (kernels/team.c)
        assert seen == [(0, 1000, 2)]
    else:
        assert sorted(seen) == [(0, 500, 0), (500, 1000, 0)]
    seen.clear()
    ops._rows(rows(8, 576, 9), lambda r0, r1, t: seen.append((r0, r1, t)))  # a decode batch
    assert seen == [(0, 8, 0)]


def test_a_split_call_gives_the_numbers_of_one_thread(ops: NativeRowOps) -> None:
    """Every row is one thread's whatever the split: two threads give bitwise what one
    gives (the pages' numerics do not depend on the thread count)."""
    x, delta = rows(1000, 96, 12), rows(1000, 96, 13)
    weight = 1 + 0.1 * rows(1, 96, 14)[0]
    gate_up = rows(700, 2 * 48, 15)
    split = [ops.rms_norm(x, weight, 1e-6), ops.silu_mul(gate_up)]
    res_split = x.clone()
    split.append(ops.add_rms_norm(res_split, delta, weight, 1e-6))
    torch.set_num_threads(1)
    try:
        one = [ops.rms_norm(x, weight, 1e-6), ops.silu_mul(gate_up)]
        res_one = x.clone()
        one.append(ops.add_rms_norm(res_one, delta, weight, 1e-6))
    finally:
        torch.set_num_threads(2)
    assert all(torch.equal(a, b) for a, b in zip(split, one, strict=True))
    assert torch.equal(res_split, res_one)


def test_what_the_kernels_do_not_take_goes_to_torch(ops: NativeRowOps) -> None:
    x = rows(6, 32, 10)
    weight = torch.ones(32)
    half = x.bfloat16()
    assert ops.rms_norm(half, weight.bfloat16(), 1e-6).dtype == torch.bfloat16
    strided = rows(6, 64, 11)[:, ::2]  # rows whose floats are not side by side
    close(ops.rms_norm(strided, weight, 1e-6), TORCH.rms_norm(strided, weight, 1e-6))
    close(ops.silu_mul(strided), TORCH.silu_mul(strided))
