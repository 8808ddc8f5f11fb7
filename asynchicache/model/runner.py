"""Runs the model over a batch of sequences whose KV lives in a paged pool.

`ForwardBatch` gives, per sequence, the new token ids, how many of its tokens
are already in the pool (`start`: a cached prefix or earlier chunks) and its
page table. A batch may mix prefill chunks at any `start` and single-token
decodes. The runner flattens all new tokens into one `[T]` batch, builds the
attention metadata once, and returns float32 logits for the last new token of
each sequence only, plus, for sequences flagged in `every_position` (requests
that want prompt logprobs), the logits of each of their new tokens.

Attention reads the pool in place through the native kernel where it can
(`attention_kernel`: float32 on CPU, a C compiler at hand); the plan then is
one page table and one work item per sequence. Otherwise it gathers pages and
uses torch (prefill spans, decodes in length groups). With the kernel, an `OpChoice`
(model/op_choice.py, measured at start-up) says per op and shape class (prefill
or decode rows) where torch's op runs instead of ours, as it is faster there.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from asynchicache.common.keys import (
    NATIVE8_NUMERICS_VERSION,
    NATIVE_NUMERICS_VERSION,
    NUMERICS_VERSION,
)
from asynchicache.model import native
from asynchicache.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    PagedAttention,
    PrefillSpan,
)
from asynchicache.model.llama import LlamaForCausalLM
from asynchicache.model.model_config import ModelConfig
from asynchicache.model.native import KernelThreads, KernelWork
from asynchicache.model.op_choice import ChosenRowOps, OpChoice
from asynchicache.model.row_ops import NativeRowOps, RowOps


def attention_kernel(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    use: bool | None = None,
    isa: str | None = None,
) -> KernelThreads | None:
    """The native attention kernel with threads to share it, or None for torch's path.

    `use`: None picks the kernel where it fits and builds; False never; True requires it
    (raises where it cannot be had). `isa`: the build (a name of `native.ISAS`; None: the
    host's widest, or $ASYNCHICACHE_KERNEL_ISA). The choice changes the KV's last bits, so
    it is part of the cache's namespace (`numerics_version`)."""
    group = config.num_heads // config.num_kv_heads
    fits = native.supports(dtype, torch.device(device), config.head_dim, group)
    kernel = native.load(isa) if fits and use is not False else None
    if use and kernel is None:
        raise RuntimeError("the native attention kernel does not fit or could not be built")
    if kernel is None:
        return None
    cores = len(os.sched_getaffinity(0))
    if kernel.team or cores == 1:  # its calls run on torch's OpenMP threads (native.py)
        return KernelThreads(kernel)
    workers = ThreadPoolExecutor(cores - 1, thread_name_prefix="attention")
    return KernelThreads(kernel, workers)


def numerics_version(kernel: KernelThreads | None, choice: OpChoice | None = None) -> int:
    """The cache namespace's numerics version of KV computed with or without the kernel
    (whose vectors' lanes order its sums: AVX2's 8 or 16), and with `choice` of ours or
    torch's per op (none: ours everywhere; the choice is folded into the version)."""
    if kernel is None:
        return NUMERICS_VERSION
    base = NATIVE8_NUMERICS_VERSION if kernel.kernel.lanes == 8 else NATIVE_NUMERICS_VERSION
    return (choice or OpChoice()).version(base)


def prefill_timer(
    model: LlamaForCausalLM, kernel: KernelThreads, tokens: int
) -> Callable[[OpChoice], float]:
    """choice -> seconds of one prefill of `tokens` tokens with `kernel` and `choice`, into
    a private pool (what `op_choice.settle` compares)."""
    c, page_size = model.config, 16
    pages = -(-tokens // page_size)
    weight = model.embed_tokens.weight
    pool = torch.zeros(pages, c.num_layers, 2, page_size, c.num_kv_heads, c.head_dim,
                       dtype=weight.dtype, device=weight.device)  # fmt: skip
    ids = [(7 * i + 3) % c.vocab_size for i in range(tokens)]
    batch = ForwardBatch([ids], [0], [list(range(pages))])

    def run(choice: OpChoice) -> float:
        runner = ModelRunner(model, pool, page_size, kernel, choice)
        began = time.perf_counter()
        runner.forward(batch)
        return time.perf_counter() - began

    return run


@dataclass(frozen=True)
class ForwardBatch:
    """Per sequence: new tokens, tokens already in the pool, and pages covering both."""

    token_ids: Sequence[Sequence[int]]
    starts: Sequence[int]
    page_tables: Sequence[Sequence[int]]
    every_position: Sequence[bool] = ()  # empty: no sequence wants more than its last row

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.starts) == len(self.page_tables)):
            raise ValueError(
                f"ForwardBatch: {len(self.token_ids)} token lists, {len(self.starts)} starts, "
                f"{len(self.page_tables)} page tables; they must match"
            )
        if not self.token_ids:
            raise ValueError("ForwardBatch: no sequences")
        for i, (ids, start) in enumerate(zip(self.token_ids, self.starts, strict=True)):
            if len(ids) == 0:
                raise ValueError(f"ForwardBatch: sequence {i} has no new tokens")
            if start < 0:
                raise ValueError(f"ForwardBatch: sequence {i} has start {start} < 0")

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)


class ModelRunner:
    """Owns nothing but a view of the KV pool; the model and pool come from outside.

    kv_pool: [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], in the
    model's dtype and on its device; index 0 of the `2` axis is K, 1 is V.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_pool: torch.Tensor,
        page_size: int,
        kernel: KernelThreads | None = None,
        choice: OpChoice | None = None,
    ) -> None:
        """`choice`: where torch's ops run instead of the kernel's (None: nowhere)."""
        config = model.config
        expected = (config.num_layers, 2, page_size, config.num_kv_heads, config.head_dim)
        if kv_pool.dim() != 6 or tuple(kv_pool.shape[1:]) != expected:
            raise ValueError(
                f"kv_pool shape {tuple(kv_pool.shape)} does not fit the model: expected "
                f"[num_pages, {', '.join(map(str, expected))}]"
            )
        weight = model.embed_tokens.weight
        if kv_pool.dtype != weight.dtype or kv_pool.device != weight.device:
            raise ValueError(
                f"kv_pool is {kv_pool.dtype} on {kv_pool.device}; the model is "
                f"{weight.dtype} on {weight.device}"
            )
        self.model = model
        self.kv_pool = kv_pool
        self.page_size = page_size
        self.num_pages = kv_pool.shape[0]
        self.device = weight.device
        self.kernel = kernel
        self.choice = choice or OpChoice()
        # The native row kernels come with the attention kernel (one library, one namespace).
        self.ops: RowOps = RowOps()
        if kernel is not None:
            self.ops = ChosenRowOps(NativeRowOps(kernel), self.choice)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [num_seqs + extra, vocab] (float32): each sequence's last new token, then
        every new token of each sequence flagged in `every_position`, in batch order."""
        plan = _BatchPlan(batch, self.page_size, self.num_pages)
        rows = len(plan.input_ids)
        kernel = self.kernel if self.choice.native("attention", rows) else None
        meta = plan.metadata(self.device, self.model.config if kernel else None)
        windows = self.model.config.sliding_windows
        attn = PagedAttention(self.kv_pool, meta, windows, kernel, self.ops)
        input_ids = self._tensor(plan.input_ids)
        positions = self._tensor(plan.positions)
        logit_rows = self._tensor(plan.last_rows)
        return self.model(input_ids, positions, attn, logit_rows, self.ops)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)


class _BatchPlan:
    """The flattened batch, computed on the host with numpy before one copy each."""

    def __init__(self, batch: ForwardBatch, page_size: int, num_pages: int) -> None:
        self.batch = batch
        self.page_size = page_size
        lengths = np.array([len(ids) for ids in batch.token_ids], dtype=np.int64)
        self.ends = np.cumsum(lengths)  # [seqs]
        self.begins = self.ends - lengths
        every = [i for i, flag in enumerate(batch.every_position) if flag]
        self.last_rows = np.concatenate(
            [self.ends - 1, *(np.arange(self.begins[i], self.ends[i]) for i in every)]
        )
        self.input_ids = np.fromiter(
            (t for ids in batch.token_ids for t in ids), dtype=np.int64, count=int(self.ends[-1])
        )
        self.tables = [self._table(i, num_pages) for i in range(batch.num_seqs)]
        self.positions = np.concatenate(
            [
                np.arange(s, s + n, dtype=np.int64)
                for s, n in zip(batch.starts, lengths, strict=True)
            ]
        )

    def _table(self, i: int, num_pages: int) -> np.ndarray:
        """Sequence i's page ids covering [0, start + new), validated."""
        total = self.batch.starts[i] + len(self.batch.token_ids[i])
        needed = -(-total // self.page_size)
        table = np.asarray(self.batch.page_tables[i][:needed], dtype=np.int64)
        if len(table) < needed:
            raise ValueError(
                f"sequence {i} needs {needed} pages for {total} tokens; its page table has "
                f"{len(self.batch.page_tables[i])}"
            )
        if table.min() < 0 or table.max() >= num_pages:
            raise ValueError(f"sequence {i} has a page id outside [0, {num_pages})")
        return table

    def metadata(self, device: torch.device, kernel_for: ModelConfig | None) -> AttentionMetadata:
        """The batch's attention metadata: the kernel's work when `kernel_for` (the model's
        config) is given, else torch's prefill spans and decode groups."""
        write_pages = np.concatenate(
            [
                table[np.arange(s, s + len(ids)) // self.page_size]
                for table, s, ids in zip(
                    self.tables, self.batch.starts, self.batch.token_ids, strict=True
                )
            ]
        )
        pages = torch.from_numpy(write_pages).to(device)
        offsets = torch.from_numpy(self.positions % self.page_size).to(device)
        if kernel_for is not None:
            return AttentionMetadata(pages, offsets, kernel_work=self._work(kernel_for))
        return AttentionMetadata(pages, offsets, self._prefills(device), self._decodes(device))

    def _work(self, config: ModelConfig) -> KernelWork:
        """Every sequence as one kernel item: its table, first row, new rows, first position."""
        offsets = np.cumsum([0, *(len(t) for t in self.tables)])[:-1]
        counts = (self.ends - self.begins).tolist()
        items = np.stack(
            [offsets, self.begins, self.ends - self.begins, np.asarray(self.batch.starts)], axis=1
        ).astype(np.int64)  # [seqs, 4]
        group = config.num_heads // config.num_kv_heads
        return KernelWork(
            tables=torch.from_numpy(np.concatenate(self.tables)),
            items=torch.from_numpy(np.ascontiguousarray(items)),
            scale=1.0 / math.sqrt(config.head_dim),
            tasks=KernelWork.count_tasks(counts, config.num_kv_heads, group),
        )

    def _prefills(self, device: torch.device) -> tuple[PrefillSpan, ...]:
        return tuple(
            PrefillSpan(
                int(self.begins[i]),
                int(self.ends[i]),
                self.batch.starts[i],
                torch.from_numpy(self.tables[i]).to(device),
            )
            for i in range(self.batch.num_seqs)
            if len(self.batch.token_ids[i]) > 1
        )

    def _decodes(self, device: torch.device) -> tuple[DecodeGroup, ...]:
        """Single-token sequences in groups of similar length (see `length_groups`)."""
        seqs = [i for i in range(self.batch.num_seqs) if len(self.batch.token_ids[i]) == 1]
        groups = length_groups([len(self.tables[i]) for i in seqs], GROUP_OVERHEAD_PAGES)
        whole = len(seqs) == self.batch.num_seqs and len(groups) == 1
        # Within a group, batch order: a decode-only batch of one group is the batch as is.
        return tuple(
            self._decode_group([seqs[j] for j in sorted(g)], device, whole) for g in groups
        )

    def _decode_group(self, seqs: list[int], device: torch.device, whole: bool) -> DecodeGroup:
        max_pages = max(len(self.tables[i]) for i in seqs)
        page_ids = np.zeros((len(seqs), max_pages), dtype=np.int64)  # padding: page 0, masked
        for row, i in enumerate(seqs):
            page_ids[row, : len(self.tables[i])] = self.tables[i]
        rows = self.begins[seqs]
        lengths = np.array([self.batch.starts[i] + 1 for i in seqs], dtype=np.int64)
        return DecodeGroup(
            rows=torch.from_numpy(rows).to(device),
            page_ids=torch.from_numpy(page_ids.reshape(-1)).to(device),
            lengths=torch.from_numpy(lengths).to(device),
            max_pages=max_pages,
            contiguous=whole,
        )


# Splitting decodes into one more group costs about what attending to this many
# padding pages more costs (a gather and an SDPA call per layer; measured on CPU).
GROUP_OVERHEAD_PAGES = 6


def length_groups(pages: Sequence[int], overhead: int) -> list[list[int]]:
    """Partition indices of `pages` into groups that minimize padded pages + overhead.

    Every decode of a group attends over the group's longest page table, so a
    short sequence next to a long one reads padding. Sorted by length, the best
    partition is contiguous runs, found by dynamic programming: cost of a run =
    its size x its longest + `overhead`. Groups come out longest first.
    """
    order = sorted(range(len(pages)), key=lambda i: pages[i])
    n = len(order)
    best = [0] * (n + 1)  # best[j]: cheapest cost of the first j (shortest) sequences
    cut = [0] * (n + 1)  # where the last run of that best partition begins
    for j in range(1, n + 1):
        longest = pages[order[j - 1]]
        best[j], cut[j] = min((best[i] + (j - i) * longest + overhead, i) for i in range(j))
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups
