"""vLLM's paged KV tensors <-> our pages: batched copies (`BlockCopier`).

Our page is `[layers, 2, page_size, kv_heads, head_dim]` (cache.pools.KVLayout),
so a vLLM block of `block_size` tokens is `block_size // page_size` of our pages.
Each layer's tensor is seen through its tiled K and V views (the formats and `TiledKV`:
integrations/vllm/layouts/tiled_layout.py), so a page of ours is copied in one strided copy.
Every copy of whole blocks is a batched gather/scatter over all blocks of a job, one pass
per layer: never a Python loop over pages. A save reads only the token rows of
the pages it copies: the kernel blocks it covers in part (a decode step's new
page) are copied as token ranges, one copy per layer and block (block 128 /
page 16: one decode page read 0.74 ms of CPU for SmolLM2's 30 layers, where
gathering its whole block took 2.3 ms). vLLM may split a manager block into
`ratio` kernel blocks (the tensor then has `ratio` times the blocks); block
`b` is kernel blocks `b * ratio .. b * ratio + ratio - 1`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from asynchicache.integrations.vllm.layouts.tiled_layout import (
    BACKEND_FORMATS,
    BlockFormat,
    BlockGeometry,
    TiledKV,
    canonical_kv,
    detect_format,
    tiled_kv,
)

# The formats and views live in tiled_layout.py; their users import them from here too.
__all__ = [
    "BACKEND_FORMATS",
    "BlockCopier",
    "BlockFormat",
    "BlockGeometry",
    "TiledKV",
    "canonical_kv",
    "detect_format",
    "tiled_kv",
]


@dataclass
class _Run:
    """Pages `first .. first + pages - 1` of kernel block `kernel_block`: the job's
    pages `job_page ..`."""

    kernel_block: int
    first: int
    job_page: int
    pages: int


class BlockCopier:
    """Copies pages between vLLM blocks and L2 page slots for all layers.

    `views` are the tiled K and V views (`TiledKV`), in layer order. `pool` is the L2 pool as
    `[slots, layers, 2, page_size, kv_heads, head_dim]` (HostPool.tensor); a job
    names block ids and, per block, its `pages_per_block` slots in token order.
    Saves read only the token rows of the pages they copy (a decode step fills
    one page of a block). Loads of whole blocks are gathered and scattered on
    vLLM's tensors as they lie in memory (dense rows); the transposes happen in
    copies between scratch buffers that are kept and reused (fresh allocations
    fault their pages in, which on a busy host costs more than the copies). Loads
    into host tensors copy runs of consecutive blocks over consecutive slots
    straight from L2 instead (one pass: what a restart's freshly allocated slots
    and blocks are).
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], fmt: BlockFormat, ratio: int, page_size: int
    ) -> None:
        if not tensors:
            raise ValueError("no attention layers to copy")
        self.tensors = list(tensors)
        self.fmt = fmt
        self.views = [tiled_kv(t, fmt) for t in self.tensors]
        first = self.views[0][0]
        self.ratio = ratio
        self.kernel_block_size = first.block_size
        if self.kernel_block_size % page_size:
            raise ValueError(
                f"page_size {page_size} must divide vLLM's (kernel) block size "
                f"{self.kernel_block_size}"
            )
        tile = max(view.a for view in self.views[0])
        if page_size % tile:
            raise ValueError(
                f"page_size {page_size} must be a multiple of {tile}: {fmt.value} blocks "
                f"keep tokens in tiles of {tile}"
            )
        self.page_size = page_size
        self.pages_per_kernel_block = self.kernel_block_size // page_size
        # K, V per layer as [kernel blocks, pages per kernel block, P/a, a, H, D/b, b] (views)
        self.page_views = [tuple(v.pages(page_size) for v in kv) for kv in self.views]
        self.pages_per_block = self.pages_per_kernel_block * ratio
        self.num_layers = len(self.views)
        self.num_kv_heads = first.num_kv_heads
        self.head_dim = first.head_dim
        self.dtype = first.element_dtype
        self.device = first.blocks.device
        self._block_dim = 1 if fmt is BlockFormat.KV_FIRST else 0
        self._scratch_bufs: dict[tuple[str, str], torch.Tensor] = {}
        for view in (view for pair in self.views for view in pair):
            if _kind(view) != _kind(first):
                raise ValueError("all attention layers must share one KV shape and dtype")

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        # [layers, 2, page_size, kv_heads, head_dim]
        return (self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)

    def kernel_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Kernel block ids of manager blocks `block_ids`, in token order."""
        ids = torch.as_tensor(list(block_ids), dtype=torch.long)
        if self.ratio > 1:
            ids = (ids[:, None] * self.ratio + torch.arange(self.ratio)).reshape(-1)
        return ids.to(self.device)

    def _check(
        self, block_ids: Sequence[int], slots: Sequence[int], pool: torch.Tensor, first: int = 0
    ) -> None:
        """`slots` are pages `first ..` of the blocks, in token order; every block but the
        last is covered to its end and the last one at least in part."""
        ppb = self.pages_per_block
        end, n = first + len(slots), len(block_ids)
        if n and not (0 <= first < ppb and (n - 1) * ppb < end <= n * ppb):
            raise ValueError(
                f"{n} blocks of {ppb} pages cannot hold {len(slots)} slots from page {first}"
            )
        if not block_ids and slots:
            raise ValueError(f"{len(slots)} slots and no blocks")
        if tuple(pool.shape[1:]) != self.page_shape or pool.dtype != self.dtype:
            raise ValueError(
                f"L2 pool pages are {tuple(pool.shape[1:])} {pool.dtype}, vLLM's blocks "
                f"make {self.page_shape} {self.dtype}"
            )

    def _scratch(self, name: str, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        """A reused buffer of `shape` (grown, never shrunk)."""
        numel = math.prod(shape)
        key = (name, str(device))
        buf = self._scratch_bufs.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=self.dtype, device=device)
            self._scratch_bufs[key] = buf
        return buf[:numel].view(*shape)

    def warm_up(self, max_blocks: int, max_bytes: int = 256 << 20) -> None:
        """Allocate and touch the scratch buffers for jobs of up to `max_blocks` blocks
        (each buffer capped at `max_bytes`), so the first job does not pay for it."""
        _, two, p, h, d = self.page_shape
        k = self.pages_per_kernel_block
        block_bytes = math.prod(self.page_shape) * self.dtype.itemsize * k
        n = max(1, min(max_blocks * self.ratio, max_bytes // block_bytes))
        cpu = torch.device("cpu")
        self._scratch("staging", (n, k, self.num_layers, two, p, h, d), cpu).zero_()
        self._scratch("pages", (n * k, self.num_layers, two, p, h, d), cpu).zero_()
        self._rows(n).zero_()

    def _rows(self, n: int) -> torch.Tensor:
        """Scratch for `n` blocks of one layer in vLLM's own order (dense)."""
        shape = list(self.tensors[0].shape)
        shape[self._block_dim] = n
        return self._scratch("rows", shape, self.device)

    def save(
        self,
        block_ids: Sequence[int],
        pool: torch.Tensor,
        slots: Sequence[int],
        first_page: int = 0,
    ) -> int:
        """vLLM blocks -> L2 slots: pages `first_page ..` of `block_ids` (in token order)
        into `slots`; returns the bytes copied. Only those pages' token rows are read: a
        kernel block the job covers whole is gathered with the others as dense rows, a
        kernel block it covers in part (a decode step's one new page of a 128-token
        block, 1/8 of it) is copied as a token range, straight into the slots."""
        self._check(block_ids, slots, pool, first_page)
        whole_ids: list[int] = []
        whole_slots: list[int] = []
        for run in self._kernel_runs(block_ids, first_page, len(slots)):
            own = slots[run.job_page : run.job_page + run.pages]
            if run.pages == self.pages_per_kernel_block:
                whole_ids.append(run.kernel_block)
                whole_slots += own
            else:
                self._save_range(run, pool, own)
        if whole_ids:
            self._save_whole(whole_ids, pool, whole_slots)
        return len(slots) * math.prod(self.page_shape) * self.dtype.itemsize

    def _save_whole(self, ids: Sequence[int], pool: torch.Tensor, slots: Sequence[int]) -> None:
        """Whole kernel blocks `ids` into `slots` (k per block, in order). On the host, runs
        of consecutive blocks over consecutive slots (a prompt's fresh slots) are copied
        straight into L2, the transposes inside the one pass (half the time of gather,
        transpose and scatter: 28.5 -> 14.3 ms for a 1,024-token SmolLM2 prompt on one
        thread, block_copies_bench.py); the rest, and blocks on a device, are gathered."""
        if self.device.type != "cpu":
            self._save_blocks(ids, pool, slots)
            return
        runs, rest = _split_runs(ids, slots, self.pages_per_kernel_block)
        for first_slot, first_block, n in runs:
            self._save_run(pool, first_slot, first_block, n)
        if rest:
            rest_slots = _slots_of(rest, slots, self.pages_per_kernel_block)
            self._save_blocks([ids[i] for i in rest], pool, rest_slots)

    def _save_run(self, pool: torch.Tensor, first_slot: int, first_block: int, n: int) -> None:
        """`n` kernel blocks from `first_block` on into the `n * k` slots from `first_slot`."""
        for pages, blocks in self._run_parts(pool, first_slot, first_block, n):
            pages.copy_(blocks)

    def _run_parts(
        self, pool: torch.Tensor, first_slot: int, first_block: int, n: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, K then V: the `n * k` slots from `first_slot` and the `n` kernel
        blocks from `first_block`, both as `[n, k, P/a, a, H, D/b, b]` views (a run's
        one-pass copy)."""
        k = self.pages_per_kernel_block
        _, two, p, h, d = self.page_shape
        slots = pool[first_slot : first_slot + n * k].view(n, k, self.num_layers, two, p, h, d)
        for layer, pair in enumerate(self.views):
            for kv, view in enumerate(pair):
                blocks = self.page_views[layer][kv][first_block : first_block + n]
                yield view.tile(slots[:, :, layer, kv]), blocks

    def _kernel_runs(self, block_ids: Sequence[int], first_page: int, n: int) -> list[_Run]:
        """The job's `n` pages from page `first_page` of `block_ids`, as runs of pages
        within one kernel block each, in token order."""
        ppb, k = self.pages_per_block, self.pages_per_kernel_block
        runs: list[_Run] = []
        for j in range(n):
            page = first_page + j
            kernel = block_ids[page // ppb] * self.ratio + (page % ppb) // k
            if runs and runs[-1].kernel_block == kernel:
                runs[-1].pages += 1
            else:
                runs.append(_Run(kernel, page % k, j, 1))
        return runs

    def _save_range(self, run: _Run, pool: torch.Tensor, slots: Sequence[int]) -> None:
        """Pages `run.first .. ` of one kernel block, as a token range of each layer."""
        pages = slice(run.first, run.first + run.pages)
        if all(b - a == 1 for a, b in itertools.pairwise(slots)):
            dst = pool[slots[0] : slots[0] + run.pages]  # [m, layers, 2, P, H, D]
            for layer, pair in enumerate(self.page_views):
                for kv, view in enumerate(pair):
                    tiles = self.views[layer][kv]
                    tiles.tile(dst[:, layer, kv]).copy_(view[run.kernel_block, pages])
            return
        index = torch.as_tensor(list(slots), dtype=torch.long)
        for layer, pair in enumerate(self.page_views):
            for kv, view in enumerate(pair):
                tiles = self.views[layer][kv]
                src = tiles.untile(view[run.kernel_block, pages]).to(pool.device)
                pool[:, layer, kv].index_copy_(0, index, src)

    def _save_blocks(self, ids: Sequence[int], pool: torch.Tensor, slots: Sequence[int]) -> None:
        """Whole kernel blocks `ids`: one dense gather per layer, the transposes into a
        host staging buffer, one scatter into `slots` (k per block, in order)."""
        index_ids = torch.as_tensor(list(ids), dtype=torch.long).to(self.device)
        n, k = len(ids), self.pages_per_kernel_block
        _, two, p, h, d = self.page_shape
        # [kernel blocks, pages per kernel block, layers, 2, P, H, D] on the host
        staging = self._scratch(
            "staging", (n, k, self.num_layers, two, p, h, d), torch.device("cpu")
        )
        rows = self._rows(n)
        blocks = tiled_kv(rows, self.fmt)  # K, V [n, N/a, a, H, D/b, b] over `rows`
        for layer, tensor in enumerate(self.tensors):
            torch.index_select(tensor, self._block_dim, index_ids, out=rows)
            for kv, part in enumerate(blocks):
                part.tile(staging[:, :, layer, kv]).copy_(part.pages(p))
        index = torch.as_tensor(list(slots), dtype=torch.long)
        pool.index_copy_(0, index, staging.view(n * k, self.num_layers, two, p, h, d))

    def load(self, pool: torch.Tensor, slots: Sequence[int], block_ids: Sequence[int]) -> int:
        """L2 slots -> vLLM blocks: `slots` are the first pages of `block_ids` in token
        order (the last block may be filled in part: the rest of it is left as it is,
        vLLM computes it); returns the bytes copied."""
        self._check(block_ids, slots, pool)
        full = len(slots) // self.pages_per_block
        split = full * self.pages_per_block
        moved = self._load_blocks(pool, slots[:split], block_ids[:full]) if full else 0
        if split < len(slots):
            moved += self._load_tail(pool, slots[split:], block_ids[full])
        return moved

    def _load_blocks(
        self, pool: torch.Tensor, slots: Sequence[int], block_ids: Sequence[int]
    ) -> int:
        """Whole blocks. On the host, runs of consecutive blocks whose slots are
        consecutive too are copied straight from L2 into the layers (one pass, the
        transposes inside it); the rest, and blocks on a device, are gathered."""
        ids = self.kernel_ids(block_ids)
        if self.device.type != "cpu":
            return self._load_gathered(pool, slots, ids)
        k = self.pages_per_kernel_block
        runs, rest = _split_runs(ids.tolist(), slots, k)
        moved = sum(self._load_run(pool, *run) for run in runs)
        if rest:
            moved += self._load_gathered(pool, _slots_of(rest, slots, k), ids[rest])
        return moved

    def _load_run(self, pool: torch.Tensor, first_slot: int, first_block: int, n: int) -> int:
        """`n` kernel blocks from `first_block` on, from the `n * k` slots from `first_slot`."""
        for pages, blocks in self._run_parts(pool, first_slot, first_block, n):
            blocks.copy_(pages)
        k = self.pages_per_kernel_block
        return n * k * math.prod(self.page_shape) * self.dtype.itemsize

    def _load_gathered(self, pool: torch.Tensor, slots: Sequence[int], ids: torch.Tensor) -> int:
        """Kernel blocks `ids`: one batched gather from L2 and one scatter per layer."""
        n, k = len(ids), self.pages_per_kernel_block
        _, two, p, h, d = self.page_shape
        index = torch.as_tensor(list(slots), dtype=torch.long)
        pages = self._scratch("pages", (n * k, self.num_layers, two, p, h, d), torch.device("cpu"))
        torch.index_select(pool, 0, index, out=pages)
        pages_by_block = pages.view(n, k, self.num_layers, two, p, h, d)
        rows = self._rows(n)
        blocks = tiled_kv(rows, self.fmt)  # K, V [n, N/a, a, H, D/b, b] over `rows`
        for layer, tensor in enumerate(self.tensors):
            for kv, part in enumerate(blocks):
                part.pages(p).copy_(part.tile(pages_by_block[:, :, layer, kv]))
            tensor.index_copy_(self._block_dim, ids, rows)
        return pages.numel() * pages.element_size()

    def _load_tail(self, pool: torch.Tensor, slots: Sequence[int], block_id: int) -> int:
        """The first `len(slots)` pages of one block, written in place (token ranges of
        its kernel blocks), leaving the rest of the block untouched."""
        _, _, p, h, d = self.page_shape
        k = self.pages_per_kernel_block
        # [pages, layers, 2, P, H, D]
        src = pool.index_select(0, torch.as_tensor(list(slots), dtype=torch.long))
        kernel = self.kernel_ids([block_id]).tolist()
        for start in range(0, len(slots), k):
            chunk = src[start : start + k]
            c = chunk.shape[0]
            for layer, pair in enumerate(self.views):
                for kv, view in enumerate(pair):
                    # [c, P, H, D] -> [c * P, H, D], a token range of the kernel block
                    part = chunk[:, layer, kv].reshape(c * p, h, d)
                    view.tokens(kernel[start // k], 0, c * p).copy_(view.tile(part))
        return src.numel() * src.element_size()


def _split_runs(
    ids: Sequence[int], slots: Sequence[int], k: int
) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Kernel blocks `ids` (each filled by `k` of `slots`, in order) as runs of consecutive
    blocks over consecutive slots, `(first slot, first block, blocks)`, copied in one pass;
    and the positions in `ids` of the blocks whose own slots are not consecutive (they
    are gathered)."""
    runs: list[tuple[int, int, int]] = []
    rest: list[int] = []
    for i, block in enumerate(ids):
        own = slots[i * k : (i + 1) * k]
        if any(b - a != 1 for a, b in itertools.pairwise(own)):
            rest.append(i)
            continue
        if runs:
            first_slot, first_block, n = runs[-1]
            if first_block + n == block and first_slot + n * k == own[0]:
                runs[-1] = (first_slot, first_block, n + 1)
                continue
        runs.append((own[0], block, 1))
    return runs, rest


def _slots_of(positions: Sequence[int], slots: Sequence[int], k: int) -> list[int]:
    """The `k` slots of each block at `positions`, in order."""
    return [s for i in positions for s in slots[i * k : (i + 1) * k]]


def _kind(view: TiledKV) -> tuple[int, int, int, torch.dtype]:
    """What every layer's K and V must share: block size, heads, head dim, dtype."""
    return (view.block_size, view.num_kv_heads, view.head_dim, view.element_dtype)
