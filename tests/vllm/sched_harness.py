"""vLLM's real scheduler with our connector on CPU, the engine core's loop played here.

Built the way vLLM's own connector tests build one without a GPU
(tests/v1/kv_connector/unit/utils.py in vLLM's tree): a `VllmConfig` over a
config-only model folder, a `KVCacheConfig`, then vLLM's `Scheduler` or
`AsyncScheduler`, which creates our connector's scheduler half (and its cache
service) itself. The worker half is our connector's worker role on real
tensors in CPU_ATTN's layout; the "model" is `FakeModel`: for every position
a step computes it writes K/V values that encode (position, input token,
adapter), so a saved or loaded page that holds KV computed from a rejected
draft token, or under another LoRA adapter, differs byte for byte from the
right one. The steps are the engine core's: synchronous (schedule, execute,
update, new drafts) or asynchronous (schedule step N, then update step N-1).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BLOCK = 32  # vLLM's block size here (two of our 16-token pages)
PAGE = 16
HEADS, HEAD_DIM, LAYERS = 2, 16, 2
VOCAB = 1000
LAYER_NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
EOS = VOCAB - 1


def tiny_model_folder(folder: Path) -> Path:
    """A config-only Llama folder (the scheduler never loads weights)."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        eos_token_id=EOS,
    )
    config.save_pretrained(str(folder))
    return folder


def kv_value(position: int, token: int, adapter: int) -> float:
    """What FakeModel writes as K at `position` (V is its negative): exact in float32."""
    return float(adapter * 4_200_000 + token * 4096 + position)


@dataclass
class Truth:
    """A request's prompt and the tokens the model samples after it (greedy)."""

    prompt: list[int]
    continuation: list[int]
    adapter: int = 0  # 0: the base model; i: LoRA adapter i

    def token(self, position: int) -> int:
        n, m = len(self.prompt), len(self.continuation)
        if position < n:
            return self.prompt[position]
        # past max_tokens only drafts look: any fixed tokens
        return self.continuation[position - n] if position < n + m else 1 + position % 97


@dataclass
class DraftPolicy:
    """Which of the k drafts of a step are right: cycles through all right, the first
    wrong, the second wrong, ... (a wrong draft is the right token + 1)."""

    k: int
    steps: itertools.count = field(default_factory=itertools.count)

    def drafts(self, truth: Truth, next_position: int) -> list[int]:
        wrong_at = next(self.steps) % (self.k + 1)  # == k: all right
        out = []
        for i in range(self.k):
            t = truth.token(next_position + i)
            out.append((t + 1) % EOS if i == wrong_at else t)
        return out


def rank_sign(rank: int) -> float:
    """Tensor-parallel rank r's K/V are (-1)^r times rank 0's: each rank's heads differ."""
    return -1.0 if rank % 2 else 1.0


class FakeModel:
    """One rank's KV blocks: writes K/V for scheduled positions (vLLM's CPU layout)."""

    def __init__(self, num_blocks: int, heads: int = HEADS, rank: int = 0) -> None:
        from asynchicache.integrations.vllm.layouts.block_layouts import BlockFormat, canonical_kv

        # CPU_ATTN: [blocks, kv_heads, block_size, 2 * head_dim] per layer
        self.tensors = {
            name: torch.zeros(num_blocks, heads, BLOCK, 2 * HEAD_DIM) for name in LAYER_NAMES
        }
        self.views = [canonical_kv(t, BlockFormat.HEAD_MAJOR_SPLIT) for t in self.tensors.values()]
        self.sign = rank_sign(rank)

    def write(self, block_ids: Sequence[int], positions: range, tokens: list[int], adapter: int):
        for p, tok in zip(positions, tokens, strict=True):
            value = kv_value(p, tok, adapter) * self.sign
            b, off = block_ids[p // BLOCK], p % BLOCK
            for k, v in self.views:
                k[b, off].fill_(value)
                v[b, off].fill_(-value)

    def wrong_positions(self, block_ids: Sequence[int], truth: Truth, upto: int) -> list[int]:
        """Positions below `upto` whose K/V are not the truth's."""
        bad = []
        for p in range(upto):
            want = kv_value(p, truth.token(p), truth.adapter) * self.sign
            b, off = block_ids[p // BLOCK], p % BLOCK
            for k, v in self.views:
                if not (bool((k[b, off] == want).all()) and bool((v[b, off] == -want).all())):
                    bad.append(p)
                    break
        return bad


def page_is_truth(page: torch.Tensor, truth: Truth, index: int, tp: int = 1) -> bool:
    """Whether an L2 page `[layers, 2, PAGE, heads, dim]` holds page `index` of `truth`
    (with `tp` ranks' heads, each rank's in its own slice)."""
    per_rank = page.shape[3] // tp
    for i in range(PAGE):
        p = index * PAGE + i
        for rank in range(tp):
            want = kv_value(p, truth.token(p), truth.adapter) * rank_sign(rank)
            heads = page[:, :, i, rank * per_rank : (rank + 1) * per_rank]
            if not (bool((heads[:, 0] == want).all()) and bool((heads[:, 1] == -want).all())):
                return False
    return True


def connector_config(root: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Our kv_connector_extra_config: a disk folder and service of `root`'s own."""
    return {
        "disk_cache_dir": str(root / "kv"),
        "cache_service": f"ipc://{root}/run/c.sock",
        "host_cache_gb": 2_000_000 / 2**30,
        "page_size": PAGE,
        "lookup_timeout_s": 10.0,
        "prefetch_timeout_s": 10.0,
        # FakeModel computes nothing: its steps would measure a prefill no load beats
        # (test_load_policy.py sets the rates it tests the policy with).
        "load_policy": "always",
        **(extra or {}),
    }


def make_vllm_config(
    model: Path,
    connector: dict[str, Any],
    *,
    spec_tokens: int = 0,
    failure_policy: str = "recompute",
    max_batched_tokens: int = 2048,
    model_fields: dict[str, Any] | None = None,
    cache_fields: dict[str, Any] | None = None,
    kv_events: dict[str, Any] | None = None,
    tp: int = 1,
) -> Any:
    """A VllmConfig for CPU with our connector, as vLLM's scheduler tests build one."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    speculative = (
        SpeculativeConfig(
            method="ngram",
            num_speculative_tokens=spec_tokens,
            prompt_lookup_max=4,
            prompt_lookup_min=2,
        )
        if spec_tokens
        else None
    )
    return VllmConfig(
        model_config=ModelConfig(
            **{
                "model": str(model),
                "dtype": "float32",
                "seed": 0,
                "skip_tokenizer_init": True,
                **(model_fields or {}),
            }
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=max_batched_tokens,
            max_model_len=4096,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            **{"block_size": BLOCK, "enable_prefix_caching": True, **(cache_fields or {})}
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="AsynchicacheConnector",
            kv_connector_module_path="asynchicache.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=connector,
            kv_load_failure_policy=failure_policy,
        ),
        device_config=DeviceConfig("cpu"),
        speculative_config=speculative,
        kv_events_config=KVEventsConfig(**kv_events) if kv_events else None,
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )


@contextmanager
def current_config(vllm_config: Any) -> Iterator[None]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        yield


class Engine:
    """vLLM's scheduler (real), our connector's two halves (real), `FakeModel`."""

    def __init__(
        self,
        model: Path,
        root: Path,
        *,
        async_scheduling: bool = False,
        spec_tokens: int = 0,
        failure_policy: str = "recompute",
        extra: dict[str, Any] | None = None,
        num_blocks: int = 200,
        max_batched_tokens: int = 2048,
        kv_events: dict[str, Any] | None = None,
        tp: int = 1,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from asynchicache.integrations.vllm.connector import AsynchicacheConnector
        from asynchicache.integrations.vllm.worker_side import WorkerSide

        self.vllm_config = make_vllm_config(
            model,
            connector_config(root, extra),
            spec_tokens=spec_tokens,
            failure_policy=failure_policy,
            max_batched_tokens=max_batched_tokens,
            kv_events=kv_events,
            tp=tp,
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    list(LAYER_NAMES),
                    FullAttentionSpec(
                        block_size=BLOCK,
                        num_kv_heads=HEADS // tp,  # each rank's (vLLM's spec is per rank)
                        head_size=HEAD_DIM,
                        dtype=torch.float32,
                    ),
                )
            ],
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.async_scheduling = async_scheduling
        cls = AsyncScheduler if async_scheduling else Scheduler
        with current_config(self.vllm_config):
            self.scheduler = cls(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=BLOCK,
                log_stats=True,
            )
            # One worker connector per tensor-parallel rank, each over its own blocks.
            self.workers = [
                AsynchicacheConnector(
                    self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
                )
                for _ in range(tp)
            ]
        self.connector = self.scheduler.connector
        self.tp = tp
        self.models = [FakeModel(num_blocks, HEADS // tp, rank) for rank in range(tp)]
        for rank, (worker, model) in enumerate(zip(self.workers, self.models, strict=True)):
            assert worker._worker is not None
            worker._worker = WorkerSide(worker._worker.spec, worker._worker.config, rank=rank)
            # CPU_ATTN's fp32 kernel (backends are named with their kernel: layouts.py)
            worker._worker.register_kv_caches(model.tensors, "CPU_ATTN:vec")
        self.worker, self.model = self.workers[0], self.models[0]
        self.aggregator = KVOutputAggregator(tp)
        self.truths: dict[str, Truth] = {}
        self.requests: dict[str, Any] = {}  # vLLM's Request objects, by id
        self.stats: Counter[str] = Counter()  # the connector's stats, as vLLM reports them
        self.drafts = DraftPolicy(spec_tokens) if spec_tokens else None
        self.pending: tuple[Any, Any] | None = None  # async: the step not yet updated
        self.finished: dict[str, Any] = {}  # request id -> its last EngineCoreOutput
        self.steps = 0
        self.device_len: dict[str, int] = {}  # decoding requests: tokens the runner accepted

    # -- requests ---------------------------------------------------------------

    def add(
        self,
        req_id: str,
        truth: Truth,
        max_tokens: int,
        lora: Any = None,
        **request_fields: Any,
    ) -> Any:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(truth.prompt),
            sampling_params=params,
            pooling_params=None,
            lora_request=lora,
            block_hasher=get_request_block_hasher(BLOCK, sha256),
            **request_fields,
        )
        self.truths[req_id] = truth
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    # -- the engine core's loop ---------------------------------------------------

    def step(self) -> Any:
        """One engine-core step; returns the scheduler output."""
        with current_config(self.vllm_config):
            out = self.scheduler.schedule()
            result = self._execute(out)
            if not self.async_scheduling:
                self._update(out, result)
                if self.drafts is not None:
                    self._propose(out)
            else:
                if self.pending is not None:
                    self._update(*self.pending)
                self.pending = (out, result)
        self.steps += 1
        return out

    def run(self, max_steps: int = 400) -> None:
        """Step until no request is left (and the async pipeline is drained)."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests() and self.pending is None:
                return
            if not self.scheduler.has_requests():
                with current_config(self.vllm_config):
                    self._update(*self.pending)  # type: ignore[misc]
                self.pending = None
                continue
            self.step()
        raise AssertionError(f"requests left after {max_steps} steps")

    def _update(self, out: Any, result: Any) -> None:
        outputs = self.scheduler.update_from_output(out, result)
        for engine_outputs in outputs.values():
            stats = engine_outputs.scheduler_stats
            if stats is not None and stats.kv_connector_stats:
                self.stats.update(stats.kv_connector_stats)
            for o in engine_outputs.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o

    def _propose(self, out: Any) -> None:
        from vllm.v1.outputs import DraftTokenIds

        assert self.drafts is not None
        ids, drafts = [], []
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            ids.append(req_id)
            drafts.append(self.drafts.drafts(self.truths[req_id], request.num_tokens))
        self.scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))

    def _execute(self, out: Any) -> Any:
        """Every rank runs the step on its blocks (loads, the forward pass, saves); their
        outputs are aggregated as vLLM's executor does (KVOutputAggregator)."""
        for worker in self.workers:
            worker.bind_connector_metadata(out.kv_connector_metadata)
            worker.start_load_kv(None)  # type: ignore[arg-type]
        ids, sampled = self._forward(out)
        outputs = []
        for worker in self.workers:
            worker.wait_for_save()
            outputs.append(self._runner_output(worker, ids, sampled))
            worker.clear_connector_metadata()
        return self.aggregator.aggregate(outputs, output_rank=0)

    def _forward(self, out: Any) -> tuple[list[str], list[list[int]]]:
        """Writes every scheduled position's K/V on every rank; returns the sampled tokens."""
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id in [r.req_id for r in out.scheduled_new_reqs] + list(cached.resumed_req_ids):
            self.device_len.pop(req_id, None)  # (re)starts from a prefill
        ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            truth = self.truths[req_id]
            start = computed[req_id]
            rolled_back = req_id in self.device_len and start < self.device_len[req_id] - 1
            if rolled_back and not self.async_scheduling:
                # A synchronous load that failed is recomputed from its first bad
                # block: vLLM rolled the request back, it starts again from there.
                del self.device_len[req_id]
            if req_id in self.device_len:
                # A decode step. Under async scheduling the scheduler counted the drafts
                # of the step in flight as computed; the runner (as vLLM's does on the
                # device) starts after the tokens really accepted.
                start = self.device_len[req_id] - 1
                assert self.async_scheduling or start == computed[req_id]
            drafts = list(out.scheduled_spec_decode_tokens.get(req_id, []))
            known = n - len(drafts)
            tokens = [truth.token(p) for p in range(start, start + known)] + drafts
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            for model in self.models:
                model.write(blocks, range(start, start + n), tokens, truth.adapter)
            ids.append(req_id)
            end = start + known  # the first position whose token is sampled now
            if end < len(truth.prompt):
                sampled.append([])  # a prefill chunk samples nothing
                continue
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == truth.token(end + accepted):
                accepted += 1
            sampled.append([truth.token(end + i) for i in range(accepted + 1)])
            self.device_len[req_id] = end + accepted + 1
        return ids, sampled

    @staticmethod
    def _runner_output(worker: Any, ids: list[str], sampled: list[list[int]]) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        _, recved = worker.get_finished(set())
        output = KVConnectorOutput(
            finished_recving=recved,
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
            kv_connector_stats=worker.get_kv_connector_stats(),
        )
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[list(t) for t in sampled],
            kv_connector_output=output,
        )

    # -- what the connector holds ---------------------------------------------------

    @property
    def side(self) -> Any:
        """Our connector's scheduler half (SchedulerSide)."""
        return self.connector._sched

    def l2_pages(self) -> dict[bytes, torch.Tensor]:
        """Every READY page in L2, by hash."""
        from asynchicache.hierarchy.l2.ledger import SlotState

        side = self.side
        pool = side.pool.tensor
        out = {}
        for slot in range(side.index.num_slots):
            if side.index.use(slot) is SlotState.READY:
                out[side.index._slots[slot].page_hash] = pool[slot].clone()
        return out

    def stat(self, name: str) -> float:
        return self.stats[name]

    def hit_tokens(self) -> float:
        return sum(self.stats[f"hit_tokens_{tier}"] for tier in ("host", "disk", "remote"))

    def settle(self, timeout_s: float = 120.0) -> None:
        """Wait until the service finished every store (their L2 pins go then)."""
        deadline = time.monotonic() + timeout_s
        while self.side.index.counts()["read"] or self.side.index.counts()["writing"]:
            if time.monotonic() > deadline:
                raise AssertionError(f"L2 not settled: {self.side.index.counts()}")
            self.side.link.wait_events(0.05)
            self.side._poll()
        self.side.index.check_integrity()

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.connector.shutdown()
