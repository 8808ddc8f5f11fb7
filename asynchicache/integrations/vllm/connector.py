"""`AsynchicacheConnector`: vLLM's v1 KV connector API over our tiers.

vLLM builds one instance per role: SCHEDULER (in the engine core) delegates to
`SchedulerSide`, WORKER (in each model worker) to `WorkerSide`. This class
only maps vLLM's methods onto them; see those modules for the behaviour.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from asynchicache.integrations.vllm.connector_config import ConnectorConfig
from asynchicache.integrations.vllm.connector_stats import (
    AsynchicachePromMetrics,
    AsynchicacheStats,
)
from asynchicache.integrations.vllm.kv_events import events_enabled
from asynchicache.integrations.vllm.layouts.numerics import qualified_backend
from asynchicache.integrations.vllm.metadata import AsynchicacheHandshake, AsynchicacheMetadata
from asynchicache.integrations.vllm.scheduler_side import SchedulerSide
from asynchicache.integrations.vllm.spec import VllmKVSpec
from asynchicache.integrations.vllm.worker_side import WorkerSide, attention_backend

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


log = logging.getLogger(__name__)


def _route_logs() -> None:
    """Our loggers write where vLLM's do (vLLM configures only its own logger)."""
    ours, theirs = logging.getLogger("asynchicache"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class AsynchicacheConnector(KVConnectorBase_V1):
    """asynchicache's L2 host, L3 disk and L4 remote tiers as a vLLM KV connector."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _route_logs()
        if kv_cache_config is None:
            raise ValueError("AsynchicacheConnector needs vLLM's KVCacheConfig (vLLM >= 0.11)")
        self._config = ConnectorConfig.from_extra(
            self._kv_transfer_config.kv_connector_extra_config
        )
        spec = VllmKVSpec.from_vllm(vllm_config, kv_cache_config)
        if spec.block_size % self._config.page_size:
            raise ValueError(
                f"kv_connector_extra_config.page_size {self._config.page_size} must divide "
                f"vLLM's block size {spec.block_size}"
            )
        self._sched = (
            SchedulerSide(spec, self._config, events_enabled(vllm_config))
            if role is KVConnectorRole.SCHEDULER
            else None
        )
        self._worker = WorkerSide(spec, self._config) if role is KVConnectorRole.WORKER else None
        self._backend: str | None = None  # the worker's, once its KV caches are registered
        if role is KVConnectorRole.SCHEDULER and (
            self._kv_transfer_config.kv_load_failure_policy != "recompute"
        ):
            log.warning(
                "asynchicache connector: vLLM's kv_load_failure_policy is %r: a failed copy "
                "of cached KV into vLLM's blocks aborts the request; set "
                '"kv_load_failure_policy": "recompute" in --kv-transfer-config to recompute it',
                self._kv_transfer_config.kv_load_failure_policy,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # -- worker side ----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._need_worker()
        backend = attention_backend(self._vllm_config, worker.spec.layer_names)
        worker.register_kv_caches(kv_caches, backend)
        self._backend = qualified_backend(self._vllm_config, backend)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        # The scheduler half names pages by the backend it expects vLLM to select;
        # the workers tell it which one they got.
        return AsynchicacheHandshake(self._backend) if self._backend else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._need_worker().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole blocks are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        self._need_worker().wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recved = self._need_worker().take_finished_recving()
        return None, (recved or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._need_worker().take_invalid_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._need_worker().take_report()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.stats.take()
        return self._sched.take_stats() if self._sched is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()

    # -- scheduler side -------------------------------------------------------

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        backends = {m.backend for m in metadata.values() if isinstance(m, AsynchicacheHandshake)}
        self._need_sched().check_backends(backends)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._need_sched().kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        self._need_sched().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._need_sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        split = self._need_sched().hit_split(request, num_external_tokens)
        size = self._config.page_size
        sources = {
            CacheHitSource.HOST: split.host * size,
            CacheHitSource.DISK: split.disk * size,
            # vLLM names no remote tier; L4 hits count as external_unspecified there
            # (our own counter vllm:asynchicache_hit_tokens_total has tier="remote").
            CacheHitSource.EXTERNAL_UNSPECIFIED: split.remote * size,
        }
        sources = {k: v for k, v in sources.items() if v}
        rest = num_external_tokens - sum(sources.values())
        if rest > 0:
            sources[CacheHitSource.EXTERNAL_UNSPECIFIED] = (
                sources.get(CacheHitSource.EXTERNAL_UNSPECIFIED, 0) + rest
            )
        return sources

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._need_sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._need_sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._need_sched().on_worker_meta(connector_output.kv_connector_worker_meta)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._need_sched().host.events.take()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._need_sched().request_finished(request)
        return False, None  # every full block was copied to L2 in the step that filled it

    # -- stats ----------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return AsynchicacheStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return AsynchicachePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # -- helpers --------------------------------------------------------------

    def _meta(self) -> AsynchicacheMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, AsynchicacheMetadata):
            raise TypeError(f"unexpected connector metadata {type(meta).__name__}")
        return meta

    def _need_worker(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on the scheduler connector")
        return self._worker

    def _need_sched(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("a scheduler-side method was called on the worker connector")
        return self._sched
