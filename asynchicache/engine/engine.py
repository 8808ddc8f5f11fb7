"""The engine: model runner + scheduler + hierarchical cache, stepped in one loop.

`Engine` is process-agnostic: `engine.process` wraps it behind ZeroMQ for the
server, and tests and benchmarks drive it directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, is_dataclass

import torch

from asynchicache.common.keys import Namespace
from asynchicache.engine.admin import EngineAdmin
from asynchicache.engine.group import Forker, make_members
from asynchicache.engine.isolation import (
    fail_requests,
    failure_message,
    forward_input,
    pick_isolated,
    without_culprits,
)
from asynchicache.engine.protocol import (
    MAX_CACHE_SALT_CHARS,
    AdminReply,
    AdminRequest,
    CachedTokens,
    GenerateRequest,
    SamplingParams,
    TokenOutput,
)
from asynchicache.engine.request import Phase, Request
from asynchicache.engine.sampling.logprobs import collect_prompt_logprobs
from asynchicache.engine.sampling.prompt_logits import PromptLogits
from asynchicache.engine.sampling.sampler import Pick
from asynchicache.engine.scheduling.batch import Batch
from asynchicache.engine.scheduling.cost import CostModel
from asynchicache.engine.scheduling.prefill_policy import MIN_STEP_TOKENS
from asynchicache.engine.scheduling.scheduler import Scheduler
from asynchicache.engine.trace import Tracer
from asynchicache.engine.warm_up import WARM_UP_BUDGET_S, WARM_UP_GROWTH, WarmUp, warm_up
from asynchicache.hierarchy.hierarchy import HiRadixCache
from asynchicache.hierarchy.pools import KVLayout
from asynchicache.model.loader import LoadedModel, load_model
from asynchicache.model.op_choice import FORWARD_TOKENS, OpChoice, measured_choice
from asynchicache.model.runner import (
    ModelRunner,
    attention_kernel,
    numerics_version,
    prefill_timer,
)
from asynchicache.settings.config import CacheConfig, EngineConfig
from asynchicache.storage.base import PageLayout, StorageTier

log = logging.getLogger(__name__)

STORAGE_STATS_MAX_AGE_S = 1.0  # the cache service's counters: a snapshot at most this old
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Engine:
    """Runs requests to completion over the cache tiers; call `step()` in a loop."""

    def __init__(
        self,
        engine_config: EngineConfig,
        cache_config: CacheConfig,
        storage: StorageTier | None = None,
        loaded: LoadedModel | None = None,
        step_threads: Callable[[int], object] | None = None,
    ) -> None:
        """`step_threads(new_tokens)` is called before each forward pass (the engine
        process's `ThreadGovernor.for_step`: threads per step, engine/threads.py)."""
        self.config = engine_config
        self.step_threads = step_threads
        self.cache_config = cache_config
        self.loaded = loaded or load_model(
            engine_config.model, engine_config.dtype, engine_config.device
        )
        mc = self.loaded.config
        self.max_model_len = min(engine_config.max_model_len or mc.max_position, mc.max_position)
        dtype = TORCH_DTYPES[engine_config.dtype]
        self.layout = KVLayout(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            page_size=cache_config.page_size,
            dtype=dtype,
        )
        device = torch.device(engine_config.device)
        kernel = attention_kernel(mc, dtype, device)  # its choice is part of the namespace
        # Ours or torch's per op and shape class, measured (the warm-up's budget pays for it).
        began = time.monotonic()
        self.op_choice = OpChoice()
        if kernel is not None:
            prefill = prefill_timer(self.loaded.model, kernel, FORWARD_TOKENS)
            self.op_choice = measured_choice(kernel, mc, prefill=prefill)
        self.op_choice_s = time.monotonic() - began
        self.namespace = Namespace(
            self.loaded.fingerprint,
            engine_config.dtype,
            cache_config.page_size,
            numerics_version=numerics_version(kernel, self.op_choice),
        )
        self.cache = HiRadixCache(
            cache_config, self.layout, self.namespace, torch.device(engine_config.device), storage
        )
        self._register_pool(storage)
        self.runner = ModelRunner(
            self.loaded.model,
            self.cache.device_pool.tensor,
            cache_config.page_size,
            kernel,
            self.op_choice,
        )
        self.cost = CostModel.initial(
            self.layout.page_bytes, cache_config.page_size, engine_config.min_load_tokens
        )
        self.scheduler = Scheduler(engine_config, cache_config, self.cache, self.cost)
        self.forker = Forker(self.scheduler, self.runner.kv_pool)
        self.device_tokens = self.cache.stats().device.total * cache_config.page_size
        self.last_batch_size = 0
        self.eos_ids = frozenset(self.loaded.tokenizer.eos_token_ids)
        self.steps = 0  # steps that ran the scheduler and a forward (when it had a batch)
        self._generate_calls = 0
        self.computed_prompt_tokens = 0  # prompt tokens fed to the model (cache misses)
        self.failed_requests = 0  # ended by an error inside a step (engine/isolation.py)
        self.prompt_logits = PromptLogits(self.namespace, engine_config.prompt_logits_mib)
        self._early: list[Request] = []  # added since the last step, their prompt's logits kept
        self.admin_ops = EngineAdmin(self)
        self.tracer = Tracer()  # where each request's time to first token goes (trace.py)

    def _register_pool(self, storage: StorageTier | None) -> None:
        """Tell the cache service which shared-memory pool our L2 slot numbers index."""
        pool = self.cache.host_pool
        if storage is None or pool is None:
            return
        layout = PageLayout(self.config.dtype, self.layout.page_shape)
        storage.register_pool(self.namespace.encode(), pool.name, layout)

    def warm_up(self, budget_s: float = WARM_UP_BUDGET_S) -> WarmUp:
        """Run the model on growing prompts and write every L1 page once, as much as fits
        `budget_s` seconds (start-up; engine/warm_up.py). Returns what it did."""
        longest = min(self.config.max_prefill_tokens, self.max_model_len - 1, self.device_tokens)
        left = max(0.0, budget_s - self.op_choice_s)  # start-up measured the op choice
        return warm_up(self.cache, self.runner, self.cost, longest, left)

    # ---------------------------------------------------------------- requests
    def add_request(self, msg: GenerateRequest, arrived: float | None = None) -> TokenOutput | None:
        """Queue a request; returns an immediate error output when it cannot run.
        `arrived`: when the engine received it (`time.monotonic()`, engine/inbox.py:
        perhaps during the step before this call); default now."""
        n = len(msg.prompt_token_ids)
        error = None
        vocab = self.loaded.config.vocab_size
        if n == 0:
            error = "the prompt is empty"
        elif min(msg.prompt_token_ids) < 0 or max(msg.prompt_token_ids) >= vocab:
            error = f"token ids must be in [0, {vocab})"
        elif len(msg.cache_salt) > MAX_CACHE_SALT_CHARS:
            error = f"cache_salt is longer than {MAX_CACHE_SALT_CHARS} characters"
        elif n + 1 > self.max_model_len:
            error = f"the prompt has {n} tokens; this model's context is {self.max_model_len}"
        elif n + 1 > self.device_tokens:
            error = (
                f"the prompt has {n} tokens; the device cache holds {self.device_tokens} "
                "(--device-cache-tokens)"
            )
        if error is not None:
            return TokenOutput(msg.rid, (), True, "error", n, 0, error=error)
        # A group's leader alone enters the scheduler; the others wait for its prefill.
        leader = make_members(msg)[0]
        if arrived is not None:
            for member in [leader, *(leader.group.followers if leader.group else ())]:
                member.arrival = arrived
        self.scheduler.add(leader)
        self.tracer.arrived(leader)
        if self.cache_config.enable_prefix_cache and PromptLogits.usable(leader):
            self._early.append(leader)
        return None

    def abort(self, rid: str, index: int | None = None) -> bool:
        return self.scheduler.abort(rid, index)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def poll(self) -> None:
        """Complete background cache work while idle (through the scheduler, like every poll)."""
        self.scheduler.poll(idle=True)

    # -------------------------------------------------------------------- step
    def step(self) -> list[TokenOutput]:
        """Run one scheduler step and one forward pass; returns new tokens. A step that
        draws first tokens from kept logits (engine/sampling/prompt_logits.py) returns those alone,
        before any forward: they go out now, not after the next forward."""
        self.tracer.step_began()
        outputs = self._answer_early()
        self.last_batch_size = len(outputs)  # requests this step served
        if not outputs:
            batch = self.scheduler.schedule()
            self.tracer.scheduled(self.scheduler.quick_loads.landed)
            self.last_batch_size = len(batch.seqs)
            if batch.seqs:
                outputs += self._run_isolated(batch)
            self.steps += 1
        while finished := self.scheduler.drain_finished():
            for req in finished:
                if req.group is not None:  # a leader ended before its prompt was computed
                    self.forker.end_waiting(req)
                if not outputs_has(outputs, req.rid, req.index):
                    outputs.append(self._final_output(req, ()))
                self.tracer.finished(req)
        self.tracer.step_ended()
        return outputs

    def _answer_early(self) -> list[TokenOutput]:
        """First tokens of requests whose prompt's last logits are kept, drawn before any
        forward (engine/sampling/prompt_logits.py); they then queue on as preempted requests do."""
        fresh, self._early = self._early, []
        ready = [r for r in fresh if r.phase is Phase.WAITING and not r.output]
        found = [(r, self.prompt_logits.get(r)) for r in ready]
        hits = [(r, row) for r, row in found if row is not None]
        if not hits:
            return []
        rows = torch.stack([row for _, row in hits])
        picks = pick_isolated(rows, [r for r, _ in hits])
        for req, _ in hits:
            # Nothing of the prompt computed so far; its match sets this when it goes on.
            req.cached = CachedTokens(device=len(req.prompt))
        outputs = [self._append(r, p) for (r, _), p in zip(hits, picks, strict=True)]
        for req, _ in hits:
            self.tracer.answered(req)
        return outputs

    def _run_isolated(self, batch: Batch) -> list[TokenOutput]:
        """`_run`; if it raises, the step's requests end with an error and the engine goes
        on (engine/isolation.py; a forward that fails because of one request's input
        fails that request alone, `_forward_isolated`). Their final outputs come from
        the scheduler's drain."""
        try:
            return self._run(batch)
        except Exception as exc:
            log.exception("a step of %d requests failed; they end with an error", len(batch.seqs))
            message = failure_message("computing a step", exc)
            self.failed_requests += fail_requests(
                self.scheduler, {s.request.rid for s in batch.seqs}, message
            )
            return []

    def _forward_isolated(self, batch: Batch) -> tuple[Batch, torch.Tensor | None]:
        """The batch's forward: the batch that ran and its logits (None: nothing left to
        run). If it raises, what can run again without its culprits does (engine/isolation.py)."""
        try:
            return batch, self.runner.forward(forward_input(batch))
        except Exception as exc:
            log.exception("a forward of %d sequences failed; running each alone", len(batch.seqs))
            rest, failed = without_culprits(self.runner, self.scheduler, batch, exc)
            self.failed_requests += failed
        if not rest.seqs:
            return rest, None
        return rest, self.runner.forward(forward_input(rest))

    def _run(self, batch: Batch) -> list[TokenOutput]:
        self.computed_prompt_tokens += sum(
            max(0, min(s.num_new, len(s.request.prompt) - s.request.num_computed))
            for s in batch.seqs
        )
        if self.step_threads is not None:
            self.step_threads(batch.num_tokens)
        began, t0 = time.monotonic(), time.perf_counter()
        ran, logits = self._forward_isolated(batch)  # [seqs (+ every position...), vocab]
        elapsed = time.perf_counter() - t0
        if logits is None:
            return []
        clean, batch = ran is batch, ran  # a forward run again does not time the model
        self.tracer.forward([(s.request, s.num_new) for s in batch.seqs], began, elapsed)
        prefill_tokens = sum(s.num_new for s in batch.seqs if s.num_new > 1)
        if clean and prefill_tokens >= MIN_STEP_TOKENS and prefill_tokens > len(batch.seqs):
            self.cost.prefill_tok_s.observe(batch.num_tokens, elapsed)
            self.cost.prompt_steps.observe(batch.num_tokens, elapsed)
        elif clean and not prefill_tokens:  # decodes alone: a step's fixed cost
            self.cost.small_step_s.observe(elapsed)
        if any(s.request.needs_whole_prompt for s in batch.seqs):
            self._collect_prompt_logprobs(batch, logits)
        ready = self.scheduler.after_forward(batch)
        if not ready:
            return []
        index = {id(s.request): i for i, s in enumerate(batch.seqs)}
        for leader in [r for r in ready if r.group is not None]:
            for member in self.forker.fork(leader):  # sample from the leader's logits
                index[id(member)] = index[id(leader)]
                ready.append(member)
        outputs = [self._prompt_only(r) for r in ready if r.sampling.max_tokens == 0]
        ready = [r for r in ready if r.sampling.max_tokens > 0]
        rows = logits[[index[id(r)] for r in ready]]
        self._keep_prompt_logits(ready, rows)
        picks = pick_isolated(rows, ready)  # a row that fails to sample fails alone
        return outputs + [self._append(req, p) for req, p in zip(ready, picks, strict=True)]

    def _keep_prompt_logits(self, ready: list[Request], rows: torch.Tensor) -> None:
        """Keep the raw last-position logits of prompts about to draw their first token."""
        if self.prompt_logits.budget_bytes <= 0 or not self.cache_config.enable_prefix_cache:
            return
        for i, req in enumerate(ready):
            if not req.output and req.index == 0:
                self.prompt_logits.put(req, rows[i])

    def _collect_prompt_logprobs(self, batch: Batch, logits: torch.Tensor) -> None:
        """Prompt logprobs from the extra rows the runner returned (see `ForwardBatch`)."""
        row = len(batch.seqs)
        for seq in batch.seqs:
            req = seq.request
            if not req.needs_whole_prompt:
                continue
            top = req.sampling.prompt_logprobs or 0
            chunk = logits[row : row + seq.num_new]  # [num_new, vocab]
            collect_prompt_logprobs(req.prompt_logprobs, req.prompt, chunk, req.num_computed, top)
            row += seq.num_new

    def _prompt_only(self, req: Request) -> TokenOutput:
        """`max_tokens` 0: the prompt's logprobs are the whole answer."""
        self.scheduler.finish(req, "length")
        return self._final_output(req, ())

    def _append(self, req: Request, chosen: Pick | BaseException) -> TokenOutput:
        if isinstance(chosen, BaseException):
            self.failed_requests += 1
            self.scheduler.finish(req, "error", failure_message("sampling", chosen))
            return self._final_output(req, ())
        token = chosen.token
        req.output.append(token)
        if chosen.logprob is not None:
            req.cumulative_logprob += chosen.logprob.logprob
        reason = self._stop_reason(req, token)
        if reason is None:
            return self._output(req, (token,), chosen)
        self.scheduler.finish(req, reason)
        return self._final_output(req, (token,), chosen)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        sp: SamplingParams = req.sampling
        # ignore_eos skips the model's end ids only; the request's own stop ids hold (as vLLM).
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_ids):
            return "stop"
        if len(req.output) >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(req: Request, tokens: tuple[int, ...], chosen: Pick | None) -> TokenOutput:
        return _token_output(req, tokens, chosen, finished=False)

    @staticmethod
    def _final_output(
        req: Request, tokens: tuple[int, ...], chosen: Pick | None = None
    ) -> TokenOutput:
        return _token_output(req, tokens, chosen, finished=True)

    # ---------------------------------------------------------- conveniences
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, salt: str = ""
    ) -> list[TokenOutput]:
        """Run prompts together to completion; returns each request's final output,
        with `token_ids` holding every generated token (tests and benchmarks)."""
        self._generate_calls += 1  # a call may run no forward (kept logits): not `steps`
        rids = [f"gen-{self._generate_calls}-{i}" for i in range(len(prompts))]
        tokens: dict[str, list[int]] = {rid: [] for rid in rids}
        final: dict[str, TokenOutput] = {}
        for rid, prompt in zip(rids, prompts, strict=True):
            early = self.add_request(GenerateRequest(rid, tuple(prompt), sampling, salt))
            if early is not None:
                final[rid] = early
        while len(final) < len(rids):
            if not self.has_work:
                raise RuntimeError("engine idle with unfinished requests")
            for out in self.step():
                if out.rid in tokens:
                    tokens[out.rid] += out.token_ids
                    if out.finished:
                        final[out.rid] = out
            if self.last_batch_size == 0:
                time.sleep(0.0005)  # waiting on loads or copies: let them land
        return [
            TokenOutput(**{**_fields(final[rid]), "token_ids": tuple(tokens[rid])}) for rid in rids
        ]

    def admin(self, msg: AdminRequest) -> AdminReply:
        """Answer a cache admin call (engine/admin.py); never raises."""
        return self.admin_ops.handle(msg)

    @property
    def model_name(self) -> str:
        return self.loaded.name

    def integrity(self) -> dict:
        """`check_integrity()` of the cache as a payload (soak and fault tests ask for it)."""
        try:
            self.cache.check_integrity()
        except Exception as exc:  # IntegrityError, or a check that tripped over the breakage
            return {"ok": False, "error": str(exc)}
        return {"ok": True, "error": None}

    def stats(self) -> dict:
        return {
            "cache": _plain(self.cache.stats()),
            "storage": self._storage_stats(),
            "queues": self.scheduler.queue_lengths(),
            "preemptions": self.scheduler.preemptions,
            "loads_given_up": self.scheduler.loads_given_up,
            "loads_deferred": self.scheduler.loads_deferred,
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "failed_requests": self.failed_requests,
            "prompt_logits": _plain(self.prompt_logits.stats()),
            # Locks held on cached pages (0 when idle: every request released its own).
            "cache_lock_refs": sum(node.lock_ref for node in self.cache.tree.iter_nodes()),
            "prefill_tok_s_estimate": self.cost.prefill_tok_s.value,
            "torch_threads": torch.get_num_threads(),
            "request_traces": self.tracer.summary(),
        }

    def traces(self) -> dict:
        """Every kept request trace whole (engine/trace.py), for the admin op "traces"."""
        return {"traces": self.tracer.reports()}

    def _storage_stats(self) -> dict:
        """The cache service's disk/remote counters (corrupt pages, store failures...).

        The latest snapshot the service sent (never a round trip on the engine's thread:
        an older one asks for the next, which a later step's poll brings); {} before the
        first answer (`at_monotonic_s` 0: asked, or a service restarting) or without one."""
        storage = self.cache.storage
        if storage is None:
            return {}
        reply = storage.stats_snapshot(STORAGE_STATS_MAX_AGE_S)
        if reply is None:
            return {"at_monotonic_s": 0.0}
        return {
            "disk": _plain(reply.disk),
            "remote": _plain(reply.remote),
            "service": dict(reply.service),
            "at_monotonic_s": reply.at,  # server/cache_admin.py's fresh_stats waits on it
        }

    def close(self) -> None:
        self.cache.close()


def outputs_has(outputs: list[TokenOutput], rid: str, index: int = 0) -> bool:
    return any(o.rid == rid and o.index == index and o.finished for o in outputs)


def _token_output(
    req: Request, tokens: tuple[int, ...], chosen: Pick | None, finished: bool
) -> TokenOutput:
    """One output of `req`; its prompt logprobs ride on its first (sent once)."""
    prompt_lps: tuple = ()
    if req.prompt_logprobs and len(req.output) <= 1 and req.index == 0:
        prompt_lps, req.prompt_logprobs = tuple(req.prompt_logprobs), []
    return TokenOutput(
        req.rid,
        tokens,
        finished,
        req.finish_reason if finished else None,
        len(req.prompt),
        len(req.output),
        req.cached,
        req.error if finished else None,
        req.index,
        (chosen.logprob,) if chosen is not None and chosen.logprob is not None else (),
        prompt_lps,
        req.cumulative_logprob,
    )


def _fields(out: TokenOutput) -> dict:
    return {k: getattr(out, k) for k in out.__dataclass_fields__}


def _plain(obj: object) -> object:
    if is_dataclass(obj) and not isinstance(obj, type):
        return asdict(obj)
    return obj


__all__ = ["WARM_UP_GROWTH", "CachedTokens", "Engine", "WarmUp"]
