"""The worker half of `AsynchicacheConnector`: copies between vLLM's blocks and L2.

It runs where the model runs. `register_kv_caches` reads each layer's tensor
and its attention backend into a `BlockCopier` (layouts.py); the L2 segment
named in the metadata is mapped on first use. Per step:

* `start_load_kv`: load jobs, L2 slots -> vLLM blocks. For asynchronous loads
  vLLM calls it after the forward pass; the request is reported finished
  receiving the same step. A copy that fails marks its blocks invalid, so
  vLLM recomputes them; it never gets half-copied KV as valid.
* `wait_for_save`: save jobs, vLLM blocks -> L2 slots, after the forward pass
  that filled the blocks, so vLLM need not hold them any longer.

The job ids it finished or failed go back to the scheduler side in the
worker metadata; the bytes it moved in the connector stats.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from asynchicache.hierarchy.pools import HostPool, KVLayout
from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.connector_stats import AsynchicacheStats
from asynchicache.integrations.vllm.layouts.block_layouts import (
    BACKEND_FORMATS,
    BlockCopier,
    BlockGeometry,
    detect_format,
    tiled_kv,
)
from asynchicache.integrations.vllm.layouts.numerics import qualified_backend
from asynchicache.integrations.vllm.layouts.ranks import rank_heads, tensor_parallel_rank
from asynchicache.integrations.vllm.metadata import AsynchicacheMetadata, AsynchicacheWorkerMeta
from asynchicache.integrations.vllm.spec import VllmKVSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


class WorkerSide:
    """Block copies for one vLLM worker: its tensor-parallel rank's heads of each page."""

    def __init__(self, spec: VllmKVSpec, config: ConnectorConfig, rank: int | None = None) -> None:
        self.spec = spec
        self.config = config
        self._rank = rank  # this worker's tensor-parallel rank (ranks.py), asked when needed
        self.copier: BlockCopier | None = None
        self.pool: HostPool | None = None
        self.stats = AsynchicacheStats()
        self._report = AsynchicacheWorkerMeta()
        self._recved: set[str] = set()
        self._invalid: set[int] = set()

    @property
    def rank(self) -> int:
        if self._rank is None:
            self._rank = tensor_parallel_rank(self.spec.tp_size)
        return self._rank

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], backend: str) -> None:
        tensors = [kv_caches[name] for name in self.spec.layer_names]
        geometry = BlockGeometry(
            self.spec.num_blocks, self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim
        )
        fmt = detect_format(backend, tensors[0].shape, geometry)
        kernel_blocks = tiled_kv(tensors[0], fmt)[0].num_blocks
        if kernel_blocks % self.spec.num_blocks:
            raise ValueError(
                f"{kernel_blocks} kernel blocks do not split {self.spec.num_blocks} blocks evenly"
            )
        ratio = kernel_blocks // self.spec.num_blocks
        self.copier = BlockCopier(tensors, fmt, ratio, self.config.page_size)
        spec = self.spec
        self.copier.warm_up(-(-spec.max_model_len // spec.block_size))
        log.info(
            "asynchicache connector: %s layout %s, %d layers of %s, %d kernel blocks per block",
            backend,
            fmt.value,
            len(tensors),
            tuple(tensors[0].shape),
            ratio,
        )

    def _pool(self, segment: str) -> HostPool:
        if self.pool is None or self.pool.name != segment:
            if self.pool is not None:
                self.pool.close()
            spec = self.spec
            layout = KVLayout(
                spec.num_layers,
                spec.page_kv_heads,
                spec.head_dim,
                self.config.page_size,
                spec.dtype,
            )
            self.pool = HostPool.attach(segment, layout)
        return self.pool

    def start_load_kv(self, meta: AsynchicacheMetadata) -> None:
        for job in meta.loads:
            try:
                pool = self._pool(meta.segment)
                assert self.copier is not None and pool.tensor is not None
                mine = rank_heads(pool.tensor, self.rank, self.spec.num_kv_heads)
                moved = self.copier.load(mine, job.slots, job.block_ids)
                self.stats.add("bytes_load", moved)
                self._report.loads_done.append(job.job)
            except Exception:  # a failed copy is recomputed, never used
                log.exception("asynchicache: load of %d blocks failed", len(job.block_ids))
                self._invalid.update(job.block_ids)
                self._report.loads_failed.append(job.job)
            if meta.load_async:
                self._recved.add(job.req_id)

    def wait_for_save(self, meta: AsynchicacheMetadata) -> None:
        for job in meta.saves:
            try:
                pool = self._pool(meta.segment)
                assert self.copier is not None and pool.tensor is not None
                mine = rank_heads(pool.tensor, self.rank, self.spec.num_kv_heads)
                moved = self.copier.save(job.block_ids, mine, job.slots, job.first_page)
                self.stats.add("bytes_save", moved)
                self._report.saves_done.append(job.job)
            except Exception:  # the pages are just not cached
                log.exception("asynchicache: save of %d blocks failed", len(job.block_ids))
                self._report.saves_failed.append(job.job)

    def take_finished_recving(self) -> set[str]:
        out, self._recved = self._recved, set()
        return out

    def take_invalid_blocks(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def take_report(self) -> AsynchicacheWorkerMeta | None:
        if self._report.is_empty():
            return None
        out, self._report = self._report, AsynchicacheWorkerMeta()
        return out

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def attention_backend(vllm_config: VllmConfig, layer_names: tuple[str, ...]) -> str:
    """The attention backend vLLM picked for these layers as the namespace names it
    (`FLASH_ATTN`; for CPU_ATTN with its kernel, e.g. `CPU_ATTN:amx`); raises for one
    whose block layout we do not know (e.g. CPU_ATTN's neon kernel)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(layer_names))
    names = {layer.get_attn_backend().get_name() for layer in layers.values()}
    if len(names) != 1:
        raise ValueError(f"AsynchicacheConnector needs one attention backend, got {names}")
    name = qualified_backend(vllm_config, names.pop())
    if name.startswith("CPU_ATTN") and name not in BACKEND_FORMATS:
        known = ", ".join(sorted(k for k in BACKEND_FORMATS if k.startswith("CPU_ATTN")))
        raise ValueError(
            f"CPU attention kernel {name!r} is not supported by AsynchicacheConnector; "
            f"known: {known}"
        )
    return name
