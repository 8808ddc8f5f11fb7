"""vLLM block formats -> our pages, on CPU tensors shaped like each backend's.

The KV "truth" is K and V as `[blocks, tokens, kv_heads, head_dim]` per layer;
each test writes it into a tensor the way the backend's kernel reads it (the
CPU backend's head-major layout with K transposed, vLLM 0.32's token-interleaved
CUDA layout with NHD and HND strides, the older kv-first CUDA layout) and checks
that our canonical views and the block <-> page copies see exactly the truth.
(tests/vllm/test_cpu_kernel_layout.py checks the CPU builder against vLLM's kernel;
test_vllm_amx_layout.py does the same for the amx kernel's tiled blocks.)
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asynchicache.integrations.vllm.layouts.block_layouts import (
    BlockCopier,
    BlockFormat,
    BlockGeometry,
    canonical_kv,
    detect_format,
)

B, N, H, D, L = 6, 8, 2, 4, 3  # blocks, block size, kv heads, head dim, layers
P = 4  # page size: 2 pages per block


def truth(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, H, D, generator=gen), torch.randn(B, N, H, D, generator=gen)


def cpu_head_major(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """CPU_ATTN: [B, H, N, 2D]; per (block, head) K transposed [D, N], then V [N, D]."""
    t = torch.empty(B, H, N, 2 * D)
    flat = t.view(B, H, 2 * N * D)
    flat[:, :, : N * D] = k.permute(0, 2, 3, 1).reshape(B, H, D * N)  # [B, H, D, N]
    flat[:, :, N * D :] = v.permute(0, 2, 1, 3).reshape(B, H, N * D)  # [B, H, N, D]
    return t


def canonical_view(tensor: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """K and V stacked, `[blocks, 2, N, H, D]` (a copy, for comparisons)."""
    return torch.stack(canonical_kv(tensor, fmt), dim=1)


def cuda_interleaved_nhd(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """FLASH_ATTN in 0.32 with LBNHC strides: memory [B, N, H, 2D], logical [B, H, N, 2D]."""
    phys = torch.cat([k, v], dim=-1)  # [B, N, H, 2D]: each token's row is [K | V]
    return phys.permute(0, 2, 1, 3)


def cuda_interleaved_hnd(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """FLASH_ATTN in 0.32 with LBHNC strides: memory and logical [B, H, N, 2D]."""
    return torch.cat([k, v], dim=-1).permute(0, 2, 1, 3).contiguous()


def cuda_kv_first(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Older vLLM's FlashAttention: [2, B, N, H, D]."""
    return torch.stack([k, v]).contiguous()


BUILDERS = {
    "CPU_ATTN:vec": (cpu_head_major, BlockFormat.HEAD_MAJOR_SPLIT),
    "FLASH_ATTN-nhd": (cuda_interleaved_nhd, BlockFormat.TOKEN_INTERLEAVED),
    "FLASH_ATTN-hnd": (cuda_interleaved_hnd, BlockFormat.TOKEN_INTERLEAVED),
    "FLASH_ATTN-kv-first": (cuda_kv_first, BlockFormat.KV_FIRST),
}
GEOMETRY = BlockGeometry(num_blocks=B, block_size=N, num_kv_heads=H, head_dim=D)


def backend_of(name: str) -> str:
    return name.split("-")[0]


@pytest.mark.parametrize("name", BUILDERS)
def test_detect_and_canonical_view_see_the_truth(name: str) -> None:
    build, fmt = BUILDERS[name]
    k, v = truth(0)
    tensor = build(k, v)
    assert detect_format(backend_of(name), tensor.shape, GEOMETRY) is fmt
    view_k, view_v = canonical_kv(tensor, fmt)
    for view, want in ((view_k, k), (view_v, v)):
        assert view.shape == (B, N, H, D)
        assert view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        torch.testing.assert_close(view, want, rtol=0, atol=0)


def test_unknown_backend_and_shape_are_named() -> None:
    with pytest.raises(ValueError, match=r"FLASHMLA.*known: CPU_ATTN"):
        detect_format("FLASHMLA", (B, H, N, 2 * D), GEOMETRY)
    with pytest.raises(ValueError, match="unexpected KV cache tensor shape"):
        detect_format("CPU_ATTN:vec", (B, N, 2 * D), GEOMETRY)


def _layers(name: str, seed: int) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, ...]]]:
    build, _ = BUILDERS[name]
    tensors, truths = [], []
    for layer in range(L):
        k, v = truth(seed * 10 + layer)
        tensors.append(build(k, v))
        truths.append((k, v))
    return tensors, truths


@pytest.mark.parametrize("name", BUILDERS)
def test_save_writes_pages_in_our_layout_and_load_restores_blocks(name: str) -> None:
    _, fmt = BUILDERS[name]
    tensors, truths = _layers(name, 1)
    copier = BlockCopier(tensors, fmt, ratio=1, page_size=P)
    pool = torch.zeros(10, *copier.page_shape)  # [slots, layers, 2, P, H, D]
    blocks, slots = [4, 1], [7, 2, 0, 9]  # block 4 -> slots 7, 2; block 1 -> slots 0, 9
    copied = copier.save(blocks, pool, slots)
    assert copied == 4 * pool[0].numel() * 4
    for i, slot in enumerate(slots):
        block, page = blocks[i // 2], i % 2
        for layer, (k, v) in enumerate(truths):
            want_k = k[block, page * P : (page + 1) * P]
            torch.testing.assert_close(pool[slot, layer, 0], want_k, rtol=0, atol=0)
            torch.testing.assert_close(pool[slot, layer, 1], v[block, page * P : (page + 1) * P])
    # Load into other blocks of fresh, zeroed tensors: exactly the saved bytes arrive.
    for t in tensors:
        t.zero_()
    copier.load(pool, slots, [0, 5])
    for layer, t in enumerate(tensors):
        view = canonical_view(t, fmt)
        k, v = truths[layer]
        torch.testing.assert_close(view[0, 0], k[4], rtol=0, atol=0)
        torch.testing.assert_close(view[5, 1], v[1], rtol=0, atol=0)
        assert not view[[1, 2, 3, 4]].any()  # nothing else was written


@pytest.mark.parametrize("name", BUILDERS)
def test_pages_of_a_block_in_part(name: str) -> None:
    """Saves from a page inside a block, and a load that fills the first pages of its last
    block: exactly those token ranges move; the rest of the block is left as it was."""
    _, fmt = BUILDERS[name]
    tensors, truths = _layers(name, 5)
    copier = BlockCopier(tensors, fmt, ratio=1, page_size=P)
    pool = torch.zeros(6, *copier.page_shape)
    copier.save([3, 0], pool, [5, 4], first_page=1)  # block 3's 2nd page, block 0's 1st
    for layer, (k, v) in enumerate(truths):
        torch.testing.assert_close(pool[5, layer, 0], k[3, P:], rtol=0, atol=0)
        torch.testing.assert_close(pool[4, layer, 1], v[0, :P], rtol=0, atol=0)
    assert not pool[[0, 1, 2, 3]].any()
    before = [canonical_view(t, fmt).clone() for t in tensors]
    copier.load(pool, [5, 4, 5], [1, 2])  # block 1 whole, block 2's first page only
    for layer, t in enumerate(tensors):
        view, old = canonical_view(t, fmt), before[layer]
        k, v = truths[layer]
        torch.testing.assert_close(view[1, 0], torch.cat([k[3, P:], k[0, :P]]), rtol=0, atol=0)
        torch.testing.assert_close(view[2, :, :P], torch.stack([k[3, P:], v[3, P:]]))
        torch.testing.assert_close(view[2, :, P:], old[2, :, P:], rtol=0, atol=0)
        torch.testing.assert_close(view[[0, 3, 4, 5]], old[[0, 3, 4, 5]], rtol=0, atol=0)


@pytest.mark.parametrize("name", BUILDERS)
def test_load_mixing_runs_of_consecutive_slots_and_scattered_ones(name: str) -> None:
    """On the host a run of consecutive blocks over consecutive slots is copied
    straight; blocks with scattered slots are gathered; every page lands right."""
    _, fmt = BUILDERS[name]
    tensors, _ = _layers(name, 5)
    copier = BlockCopier(tensors, fmt, ratio=1, page_size=P)
    gen = torch.Generator().manual_seed(5)
    pool = torch.randn(12, *copier.page_shape, generator=gen)
    # Blocks 2, 3 from slots 0-3 (one run), block 5 from 4-5 (a run that does not
    # continue the first: block 4 is not in it), block 0 from 9, 6 (scattered),
    # block 1's first page from slot 7 (the part-filled last block).
    slots, blocks = [0, 1, 2, 3, 4, 5, 9, 6, 7], [2, 3, 5, 0, 1]
    before = [canonical_view(t, fmt).clone() for t in tensors]
    copier.load(pool, slots, blocks)
    for layer, t in enumerate(tensors):
        view = canonical_view(t, fmt)
        for i, slot in enumerate(slots):
            block, page = blocks[i // 2], i % 2
            got = view[block, :, page * P : (page + 1) * P]
            torch.testing.assert_close(got, pool[slot, layer], rtol=0, atol=0)
        torch.testing.assert_close(view[1, :, P:], before[layer][1, :, P:], rtol=0, atol=0)
        torch.testing.assert_close(view[4], before[layer][4], rtol=0, atol=0)


@pytest.mark.parametrize("name", BUILDERS)
def test_save_mixing_runs_of_consecutive_slots_and_scattered_ones(name: str) -> None:
    """On the host a run of consecutive blocks over consecutive slots is copied straight
    into L2; blocks with scattered slots are gathered; every page lands right and no
    other slot is written."""
    _, fmt = BUILDERS[name]
    tensors, truths = _layers(name, 6)
    copier = BlockCopier(tensors, fmt, ratio=1, page_size=P)
    pool = torch.zeros(12, *copier.page_shape)
    # Blocks 2, 3 into slots 0-3 (one run), block 5 into 4-5 (a run of its own: block 4
    # is not saved), block 0 into 9, 6 (scattered), block 1's first page into slot 7.
    slots, blocks = [0, 1, 2, 3, 4, 5, 9, 6, 7], [2, 3, 5, 0, 1]
    copier.save(blocks, pool, slots)
    for i, slot in enumerate(slots):
        block, page = blocks[i // 2], i % 2
        for layer, (k, v) in enumerate(truths):
            rows = slice(page * P, (page + 1) * P)
            torch.testing.assert_close(pool[slot, layer, 0], k[block, rows], rtol=0, atol=0)
            torch.testing.assert_close(pool[slot, layer, 1], v[block, rows], rtol=0, atol=0)
    assert not pool[[8, 10, 11]].any()


def test_kernel_blocks_split_a_manager_block() -> None:
    """A tensor with ratio x the manager blocks: block b is kernel blocks b*r .. b*r+r-1."""
    k, v = truth(3)  # B kernel blocks of N tokens = B/2 manager blocks of 2N tokens
    tensor = cuda_interleaved_nhd(k, v)
    copier = BlockCopier([tensor], BlockFormat.TOKEN_INTERLEAVED, 2, P)
    assert copier.pages_per_block == 4
    assert copier.kernel_ids([2, 0]).tolist() == [4, 5, 0, 1]
    pool = torch.zeros(4, *copier.page_shape)
    copier.save([2], pool, [3, 2, 1, 0])
    torch.testing.assert_close(pool[3, 0, 0], k[4, :P])
    torch.testing.assert_close(pool[0, 0, 1], v[5, P:])
    # The first 3 pages of manager block 1 (kernel blocks 2 and 3): kernel block 3's
    # second half is left as it was.
    old = canonical_view(tensor, BlockFormat.TOKEN_INTERLEAVED)[3, :, P:]
    copier.load(pool, [3, 2, 1], [1])
    view = canonical_view(tensor, BlockFormat.TOKEN_INTERLEAVED)
    torch.testing.assert_close(view[2, 0], k[4], rtol=0, atol=0)
    torch.testing.assert_close(view[3, 1, :P], v[5, :P], rtol=0, atol=0)
    torch.testing.assert_close(view[3, :, P:], old, rtol=0, atol=0)


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op makes (a copy of whole blocks shows there)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        given = {_storage(a) for a in (*args, *(kwargs or {}).values())}
        for t in out if isinstance(out, tuple | list) else (out,):
            if _storage(t) not in given:  # a new tensor, not a view or an in-place result
                self.numel = max(self.numel, t.numel())
        return out


def _storage(t: object) -> int:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else -1


@pytest.mark.parametrize("name", BUILDERS)
def test_a_decode_page_copies_only_its_rows(name: str) -> None:
    """One new page in the middle of an 8-page kernel block of a split manager block (a
    decode step's save): only that page's rows are read and copied, never the block;
    then two pages of a kernel block into slots that are not consecutive."""
    build, fmt = BUILDERS[name]
    # 6 kernel blocks of 16 tokens (3 manager blocks of 32), pages of 2 tokens
    k, v = (torch.cat([t, t]).reshape(B, 2 * N, H, D) for t in truth(8))
    small_p = P // 2
    tensor = _built(build, k, v)
    copier = BlockCopier([tensor], fmt, ratio=2, page_size=small_p)  # 16 pages per block
    pool = torch.zeros(4, *copier.page_shape)
    probe = _Largest()
    with probe:
        copied = copier.save([1], pool, [3], first_page=13)  # kernel block 3, page 5
    torch.testing.assert_close(pool[3, 0, 0], k[3, 10:12], rtol=0, atol=0)
    torch.testing.assert_close(pool[3, 0, 1], v[3, 10:12], rtol=0, atol=0)
    assert not pool[:3].any()
    page = pool[0, 0, 0].numel()  # one page of one layer's K
    assert copied == pool[0].numel() * 4
    assert probe.numel <= page, (probe.numel, page)
    with probe:
        copier.save([2], pool, [2, 0], first_page=1)  # kernel block 4, pages 1 and 2
    torch.testing.assert_close(pool[2, 0, 0], k[4, 2:4], rtol=0, atol=0)
    torch.testing.assert_close(pool[0, 0, 1], v[4, 4:6], rtol=0, atol=0)
    assert not pool[1].any()
    assert probe.numel <= 2 * page, (probe.numel, page)


def _built(
    build: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """`build` for blocks of any size (the builders above use the module's B and N)."""
    blocks, tokens = k.shape[:2]
    if build is cpu_head_major:
        t = torch.empty(blocks, H, tokens, 2 * D)
        flat = t.view(blocks, H, 2 * tokens * D)
        flat[:, :, : tokens * D] = k.permute(0, 2, 3, 1).reshape(blocks, H, D * tokens)
        flat[:, :, tokens * D :] = v.permute(0, 2, 1, 3).reshape(blocks, H, tokens * D)
        return t
    return build(k, v)


def test_mismatched_pool_or_slot_count_is_refused() -> None:
    tensors, _ = _layers("CPU_ATTN:vec", 4)
    copier = BlockCopier(tensors, BlockFormat.HEAD_MAJOR_SPLIT, 1, P)
    pool = torch.zeros(4, *copier.page_shape)
    with pytest.raises(ValueError, match="2 blocks of 2 pages cannot hold 1 slots"):
        copier.save([1, 2], pool, [0])  # the second block would be left out
    with pytest.raises(ValueError, match="cannot hold 3 slots from page 0"):
        copier.load(pool, [0, 1, 2], [1])
    with pytest.raises(ValueError, match="from page 2"):
        copier.save([1], pool, [0], first_page=2)
    with pytest.raises(ValueError, match="L2 pool pages"):
        copier.load(torch.zeros(4, L, 2, 2 * P, H, D), [0, 1], [1])
    with pytest.raises(ValueError, match="must divide"):
        BlockCopier(tensors, BlockFormat.HEAD_MAJOR_SPLIT, 1, 3)
