"""Attention over a paged KV pool, for a batch that mixes prefill chunks and decodes.

The pool is page-first, `[num_pages, num_layers, 2, page_size, num_kv_heads,
head_dim]`: one page is contiguous across all layers, and `pool[:, layer]` is a
strided view of one layer. New K/V are written through `index_put_` on such
views (never `pool[idx] = ...` on an advanced-indexed copy).

Two ways to attend, chosen per forward by the runner:

* the native kernel (`native.py`, `kernels/paged_attention.c`; float32 on CPU):
  one call per layer for the whole batch, prefill chunks and decodes alike,
  reading every page where it lies (no gather copy), shared by the engine's
  threads (`KernelThreads`);
* torch, where the kernel cannot be built or does not fit (other dtypes,
  CUDA): a prefill chunk attends with `scaled_dot_product_attention` to its
  prefix (gathered from its pages) and causally to its own new tokens; the
  decodes of the batch attend in a few padded SDPA calls, one per group of
  similar length (so that short sequences read little padding), their query
  heads folded under their KV head so that grouped-query attention needs no
  repeated K/V. A gather copies each page's K and V together (one contiguous
  block of a layer per page: 8x faster than K and V apart, which copy half
  pages through a strided view).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from asynchicache.model.native import KernelThreads, KernelWork
from asynchicache.model.row_ops import RowOps


class AttentionBackend(Protocol):
    """What a decoder layer calls to store its new K/V and attend."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, heads, hd], k/v [T, kv_heads, hd] -> [T, heads, hd]."""
        ...


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence with several new tokens (a whole prompt or a chunk of one)."""

    begin: int  # its first new token's row in the flattened batch
    end: int
    start: int  # tokens of this sequence already in the pool
    page_ids: torch.Tensor  # [pages] covering positions [0, start + end - begin)

    @property
    def num_new(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class DecodeGroup:
    """Sequences of the batch with one new token, attended together."""

    rows: torch.Tensor  # [D] their rows in the flattened batch
    page_ids: torch.Tensor  # [D * max_pages] each sequence's pages, padded with page 0
    lengths: torch.Tensor  # [D] keys each attends to, its new token included
    max_pages: int
    contiguous: bool  # rows == arange(D): the batch is this group alone, in order


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything about a batch that is the same for every layer: the kernel's work,
    or the torch path's prefill spans and decode groups."""

    write_pages: torch.Tensor  # [T] page of each new token
    write_offsets: torch.Tensor  # [T] slot of each new token within its page
    prefills: tuple[PrefillSpan, ...] = ()
    decodes: tuple[DecodeGroup, ...] = ()
    kernel_work: KernelWork | None = None


class PagedAttention:
    """An `AttentionBackend` for one forward pass over a paged KV pool."""

    def __init__(
        self,
        kv_pool: torch.Tensor,
        meta: AttentionMetadata,
        sliding_windows: tuple[int | None, ...],
        kernel: KernelThreads | None = None,
        ops: RowOps | None = None,
    ) -> None:
        self.pool = kv_pool  # [pages, layers, 2, page_size, kv_heads, hd]
        self.page_size = kv_pool.shape[3]
        self.meta = meta
        self.windows = sliding_windows
        self.kernel = kernel if meta.kernel_work is not None else None
        self.ops = ops or RowOps()
        # Masks depend on the batch and the window only: built once, shared by layers.
        self._decode_masks: dict[tuple[int, int | None], torch.Tensor] = {}
        self._prefill_masks: dict[tuple[int, int | None], torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._write(layer, k, v)
        window = self.windows[layer]
        if self.kernel is not None and self.meta.kernel_work is not None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, heads, hd]
            k_pool, v_pool = self.pool[:, layer, 0], self.pool[:, layer, 1]
            self.kernel.run(k_pool, v_pool, q, out, self.meta.kernel_work, window or 0)
            return out
        decodes = self.meta.decodes
        if len(decodes) == 1 and decodes[0].contiguous:
            return self._decode(layer, q, 0, window)
        out = torch.empty_like(q)  # [T, heads, hd]
        for span in self.meta.prefills:
            b, e = span.begin, span.end
            out[b:e] = self._prefill(layer, span, q[b:e], k[b:e], v[b:e], window)
        for i, group in enumerate(decodes):
            out.index_copy_(0, group.rows, self._decode(layer, q[group.rows], i, window))
        return out

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [T, kv_heads, hd] at their pages and offsets, in place."""
        pages, offsets = self.meta.write_pages, self.meta.write_offsets
        self.ops.scatter_(self.pool[:, layer, 0], k, pages, offsets)  # [pages, page, kvh, hd]
        self.ops.scatter_(self.pool[:, layer, 1], v, pages, offsets)

    def _gather(self, layer: int, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """page_ids [n] -> k, v [n * page_size, kv_heads, hd] (views of one gathered copy)."""
        kv = self.pool[:, layer].index_select(0, page_ids)  # [n, 2, page_size, kv_heads, hd]
        return kv[:, 0].flatten(0, 1), kv[:, 1].flatten(0, 1)

    def _prefill(
        self,
        layer: int,
        span: PrefillSpan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """q [n, heads, hd] over the prefix and, causally, the n new tokens."""
        n, total = span.num_new, span.start + span.num_new
        if span.start > 0:
            k, v = self._gather(layer, span.page_ids)
            k, v = k[:total], v[:total]  # [total, kv_heads, hd]
        mask = None
        if span.start > 0 or (window is not None and window < total):
            key = (span.begin, window)
            if key not in self._prefill_masks:
                self._prefill_masks[key] = _prefill_mask(span.start, n, total, window, q.device)
            mask = self._prefill_masks[key]  # [n, total]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, heads, n, hd]
            k.transpose(0, 1).unsqueeze(0),  # [1, kv_heads, total, hd]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )  # [1, heads, n, hd]
        return out[0].transpose(0, 1)

    def _decode(self, layer: int, q: torch.Tensor, index: int, window: int | None) -> torch.Tensor:
        """q [D, heads, hd]: the new token of each sequence of decode group `index`."""
        group = self.meta.decodes[index]
        d, heads, hd = q.shape
        k, v = self._gather(layer, group.page_ids)  # [D * max_pages * page_size, kv_heads, hd]
        kv_heads = k.shape[1]
        length = group.max_pages * self.page_size
        k = k.view(d, length, kv_heads, hd).transpose(1, 2)  # [D, kv_heads, L, hd]
        v = v.view(d, length, kv_heads, hd).transpose(1, 2)
        # Query heads sharing a KV head become extra query rows of that head.
        q = q.view(d, kv_heads, heads // kv_heads, hd)  # [D, kv_heads, group, hd]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self._decode_mask(index, length, window)
        )  # [D, kv_heads, group, hd]
        return out.reshape(d, heads, hd)

    def _decode_mask(self, index: int, length: int, window: int | None) -> torch.Tensor:
        """[D, 1, 1, L] True where a key is inside the sequence (and its window)."""
        group = self.meta.decodes[index]
        mask = self._decode_masks.get((index, window))
        if mask is None:
            keys = torch.arange(length, device=group.lengths.device)[None, :]  # [1, L]
            lengths = group.lengths[:, None]  # [D, 1]
            mask = keys < lengths
            if window is not None:
                mask &= keys > lengths - 1 - window
            mask = mask[:, None, None, :]
            self._decode_masks[(index, window)] = mask
        return mask


def _prefill_mask(
    start: int, n: int, total: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """[n, total] True where new token i (at position start + i) may see key j."""
    q_pos = torch.arange(start, start + n, device=device)[:, None]  # [n, 1]
    k_pos = torch.arange(total, device=device)[None, :]  # [1, total]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
