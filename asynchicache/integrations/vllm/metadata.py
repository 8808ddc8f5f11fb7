"""What crosses between vLLM's scheduler and its workers, each way, every step.

Scheduler -> worker (`AsynchicacheMetadata`): the L2 segment's name and this
step's copy jobs: loads (L2 slots -> vLLM blocks) and saves (vLLM blocks ->
L2 slots). A job names whole vLLM blocks and, per block, its pages' slots in
token order. Worker -> scheduler (`AsynchicacheWorkerMeta`): which jobs it
finished or failed, so the scheduler side frees, publishes or stores slots.
Only ids and slot numbers travel; KV bytes never leave shared memory. Once, at
start, each worker tells the scheduler side the attention backend it got
(`AsynchicacheHandshake`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass(frozen=True)
class CopyJob:
    """Copy pages of `block_ids` (vLLM blocks of request `req_id`) to or from `slots`:
    one slot per page in token order, from page `first_page` of the first block; the
    last block may be covered in part (pages hold `page_size` tokens, blocks several
    pages)."""

    job: int
    req_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    first_page: int = 0


@dataclass
class AsynchicacheMetadata(KVConnectorMetadata):
    segment: str
    loads: list[CopyJob] = field(default_factory=list)
    saves: list[CopyJob] = field(default_factory=list)
    load_async: bool = True


@dataclass
class AsynchicacheWorkerMeta(KVConnectorWorkerMetadata):
    loads_done: list[int] = field(default_factory=list)
    loads_failed: list[int] = field(default_factory=list)
    saves_done: list[int] = field(default_factory=list)
    saves_failed: list[int] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> AsynchicacheWorkerMeta:
        if not isinstance(other, AsynchicacheWorkerMeta):
            return self
        return AsynchicacheWorkerMeta(
            self.loads_done + other.loads_done,
            self.loads_failed + other.loads_failed,
            self.saves_done + other.saves_done,
            self.saves_failed + other.saves_failed,
        )

    def is_empty(self) -> bool:
        return not (self.loads_done or self.loads_failed or self.saves_done or self.saves_failed)


@dataclass(frozen=True)
class AsynchicacheHandshake(KVConnectorHandshakeMetadata):
    """A worker's attention backend as the namespace names it (e.g. `CPU_ATTN:vec`)."""

    backend: str
