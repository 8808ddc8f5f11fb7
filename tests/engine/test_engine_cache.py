"""The engine over the cache tiers: every cache path gives the recomputed greedy tokens."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from loop_harness import LoopHarness
from storage_doubles import MemoryStorage

from asynchicache.engine.engine import WARM_UP_GROWTH, Engine
from asynchicache.engine.protocol import GenerateRequest, SamplingParams
from asynchicache.model.loader import LoadedModel
from asynchicache.model.runner import ForwardBatch
from asynchicache.settings.config import CacheConfig, EngineConfig
from asynchicache.storage.client.storage_client import ClientConfig
from asynchicache.storage.service.in_thread import client_in_thread
from asynchicache.storage.service.server import ServiceConfig

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TEXT = (
    "The lighthouse keeper wrote in his log every evening: the weather, the ships that "
    "passed, the birds that rested on the rail, and the colour of the sea at dusk. "
)


def _prompt(model: LoadedModel, n_repeats: int, question: str) -> list[int]:
    tok = model.tokenizer
    text = TEXT * n_repeats + question
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def _engine(model: LoadedModel, **cache: object) -> Engine:
    engine_kw = {
        k: cache.pop(k)
        for k in (
            "chunked_prefill_size",
            "max_prefill_tokens",
            "max_running_requests",
            "decode_reserve_tokens",
            "prompt_logits_mib",
        )
        if k in cache
    }
    cache.setdefault("disk_cache_dir", None)
    cache.setdefault("host_cache_gb", 0.25)
    return Engine(EngineConfig(**engine_kw), CacheConfig(**cache), loaded=model)  # type: ignore[arg-type]


def test_hits_from_l1_and_l2_give_the_recomputed_tokens(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    prompt = _prompt(smollm, 6, "What did he write about?")
    plain = _engine(smollm, enable_prefix_cache=False)
    cached = _engine(smollm, device_cache_tokens=4096)
    engines += [plain, cached]
    expected = plain.generate([prompt], GREEDY)[0]
    cold = cached.generate([prompt], GREEDY)[0]
    assert cold.token_ids == expected.token_ids and cold.cached.total == 0

    l1 = cached.generate([prompt], GREEDY)[0]
    assert l1.token_ids == expected.token_ids
    assert l1.cached.device >= len(prompt) - 2 * 16

    cached.cache.drain()  # write-through copies to L2 have landed
    cached.cache.evict(cached.cache.stats().device.total)
    assert cached.cache.lookup(prompt)["device"] == 0
    l2 = cached.generate([prompt], GREEDY)[0]
    assert l2.token_ids == expected.token_ids
    assert l2.cached.host >= len(prompt) - 2 * 16


def test_a_prompt_cached_whole_computes_its_last_token_alone(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    """A prompt that ends on a page boundary and is cached whole: one token is computed
    (into a copy of the last page), from L1 and from L2, and the answer is the same."""
    prompt = _prompt(smollm, 6, "What did he see?")
    prompt = prompt[: len(prompt) // 16 * 16]
    plain = _engine(smollm, enable_prefix_cache=False)
    # The whole hit's KV path: without the prompt's kept logits (engine/sampling/prompt_logits.py).
    cached = _engine(smollm, device_cache_tokens=4096, prompt_logits_mib=0)
    engines += [plain, cached]
    expected = plain.generate([prompt], GREEDY)[0].token_ids
    assert cached.generate([prompt], GREEDY)[0].token_ids == expected
    tree_pages = cached.cache.stats().device.cached

    for tier in ("device", "host"):
        if tier == "host":
            cached.cache.drain()  # write-through copies to L2 have landed
            cached.cache.evict(cached.cache.stats().device.total)
        before = cached.computed_prompt_tokens
        out = cached.generate([prompt], GREEDY)[0]
        assert out.token_ids == expected, f"a whole hit from {tier} changed the answer"
        assert cached.computed_prompt_tokens - before == 1, f"{tier}: more than one token computed"
        assert getattr(out.cached, tier) == len(prompt) - 1 and out.cached.total == len(prompt) - 1
        # The copy went back when the tree took the page: nothing private is left.
        assert cached.cache.stats().device.cached == tree_pages
        cached.cache.check_integrity()


def test_chunked_prefill_and_shared_prefix_match_whole_prefill(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    whole = _engine(smollm, enable_prefix_cache=False, chunked_prefill_size=4096)
    chunked = _engine(
        smollm, chunked_prefill_size=37, max_prefill_tokens=37, device_cache_tokens=4096
    )  # 37 tokens a step, also with one prompt alone in hand
    engines += [whole, chunked]
    first = _prompt(smollm, 4, "Describe the sea.")
    second = _prompt(smollm, 4, "Which birds came?")  # same long prefix, other question
    for prompt in (first, second):
        assert chunked.generate([prompt], GREEDY)[0].token_ids == (
            whole.generate([prompt], GREEDY)[0].token_ids
        )
    assert chunked.cache.stats().counters.device_hit_tokens > 0


def test_batch_of_mixed_requests_matches_each_alone(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    engine = _engine(smollm, device_cache_tokens=4096, chunked_prefill_size=96)
    engines.append(engine)
    questions = ((1, "Hi?"), (5, "Why?"), (3, "How?"), (1, "Who?"))
    prompts = [_prompt(smollm, n, q) for n, q in questions]
    alone = [engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    engine.cache.clear()
    together = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert together == alone


def test_prompts_on_one_uncached_prefix_together_compute_it_once_and_answer_as_alone(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    """Two misses on one prefix in one batch: the second joins the first's computed chunks
    (scheduler `_join`) and both answer exactly as computed alone without a cache."""
    plain = _engine(smollm, enable_prefix_cache=False)
    cached = _engine(smollm, device_cache_tokens=4096, chunked_prefill_size=64)
    engines += [plain, cached]
    prompts = [_prompt(smollm, 5, "Describe the sea."), _prompt(smollm, 5, "Which birds came?")]
    alone = [plain.generate([p], GREEDY)[0].token_ids for p in prompts]
    together = cached.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == alone
    common = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    shared = common // 16 * 16
    assert together[1].cached.device >= shared - 64  # at most one chunk computed twice
    assert cached.computed_prompt_tokens <= sum(map(len, prompts)) - shared + 64


def test_l1_pressure_preempts_and_still_matches(smollm: LoadedModel, engines: list[Engine]) -> None:
    tok = smollm.tokenizer
    # No shared prefix (the question first): each request needs pages of its own.
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": f"Question {i}? " + TEXT * 3}])
        )
        for i in range(4)
    ]
    longer = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = _engine(smollm, enable_prefix_cache=False)
    # Admission reserves room for one answer token only, and L1 holds two prompts with
    # that: the two admitted outgrow L1 while decoding, and one is preempted.
    tight = _engine(smollm, device_cache_tokens=16 * 21, decode_reserve_tokens=1)
    engines += [roomy, tight]
    # One batch for the reference: 40 decode steps, not 4 x 40 (a batch answers as each
    # request alone: test_batch_of_mixed_requests_matches_each_alone).
    expected = [o.token_ids for o in roomy.generate(prompts, longer)]
    assert roomy.scheduler.preemptions == 0
    got = [o.token_ids for o in tight.generate(prompts, longer)]
    assert got == expected
    assert tight.scheduler.preemptions > 0, "the test no longer exercises preemption"


def test_l3_hit_after_restart_gives_the_recomputed_tokens(
    smollm: LoadedModel, engines: list[Engine], tmp_path: Path
) -> None:
    prompt = _prompt(smollm, 5, "What colour was the sea?")

    def disk_engine() -> Engine:
        service = ServiceConfig(tmp_path / "kv", address=f"ipc://{tmp_path}/svc.sock")
        client = client_in_thread(service, ClientConfig(service.address))
        cache = CacheConfig(disk_cache_dir=tmp_path / "kv", host_cache_gb=0.25)
        return Engine(EngineConfig(), cache, storage=client, loaded=smollm)

    first = disk_engine()
    cold = first.generate([prompt], GREEDY)[0]  # on an empty disk: the recomputed tokens
    assert cold.cached.total == 0 and first.computed_prompt_tokens == len(prompt)
    expected = cold.token_ids
    first.cache.drain()  # every L2 -> disk store has finished
    first.close()
    first.cache.storage.close()  # type: ignore[union-attr]

    second = disk_engine()
    engines.append(second)
    assert second.cache.storage.wait_ready(10)  # type: ignore[union-attr]
    out = second.generate([prompt], GREEDY)[0]
    assert out.token_ids == expected
    assert out.cached.disk >= len(prompt) - 2 * 16


def test_a_late_load_is_given_up_and_the_rest_recomputed(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    prompt = _prompt(smollm, 6, "Which ships passed?")
    storage = MemoryStorage(None)  # a storage tier whose reads wait until released
    config = CacheConfig(
        disk_cache_dir=None,
        host_cache_gb=0.25,
        device_cache_tokens=4096,
        prefetch_policy="timeout",
        prefetch_timeout_s=1e-9,
    )
    engine = Engine(EngineConfig(), config, storage=storage, loaded=smollm)
    storage.pool = engine.cache.host_pool
    engines.append(engine)
    expected = engine.generate([prompt], GREEDY)[0].token_ids
    engine.cache.drain()
    engine.cache.clear()  # only in storage now
    storage.hold = True
    out = engine.generate([prompt], GREEDY)[0]
    assert out.token_ids == expected
    assert out.cached.disk == 0, "the request waited for a load past its deadline"
    assert engine.scheduler.loads_given_up == 1
    storage.hold = False  # the given-up load (cancelled) ends; it is still work until then
    while engine.has_work:
        engine.step()
    for node in engine.cache.tree.iter_nodes():
        assert node.lock_ref == 0, f"a lock nobody holds at {node}"


@pytest.mark.slow
def test_loads_given_up_then_idle_then_clear_leave_nothing_cached(
    smollm: LoadedModel, engines: list[Engine], tmp_path: Path
) -> None:
    """The outside repro of issue 11: disk filled first, restart with `--prefetch-policy
    timeout --prefetch-timeout 0.01`, each prompt once with max_tokens 1, wait until idle,
    `/cache/clear`: pages stayed cached in L1 and L2, held by locks nobody owned."""
    tok = smollm.tokenizer
    # ~1,500 tokens (~94 pages, 69 MB) each, read by one I/O thread: no load of them
    # finishes within 0.01 s, so every one is given up and lands later. Two prompts (the
    # repro had three): one after the other, the second meets the first's late load.
    prompts = [tok.encode(f"Logbook {i}. " + TEXT * 25) for i in range(2)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def disk_engine(**cache: object) -> Engine:
        service = ServiceConfig(tmp_path / "kv", address=f"ipc://{tmp_path}/svc.sock",
                                workers=1, io_threads=1)  # fmt: skip
        client = client_in_thread(service, ClientConfig(service.address))
        config = CacheConfig(disk_cache_dir=tmp_path / "kv", host_cache_gb=0.5, **cache)
        engine = Engine(EngineConfig(), config, storage=client, loaded=smollm)
        assert client.wait_ready(10)
        return engine

    first = disk_engine()
    first.generate(prompts, one)
    first.cache.drain()  # every page is on disk
    first.close()
    first.cache.storage.close()  # type: ignore[union-attr]

    second = disk_engine(prefetch_policy="timeout", prefetch_timeout_s=0.01)
    engines.append(second)
    harness = LoopHarness(second)
    try:
        outs = [harness.generate([p], one)[0] for p in prompts]  # one at a time
        harness.wait_quiet()  # idle: nothing queued, no copy or storage ticket pending
        harness.admin("clear", tiers=("device", "host"))
        stats = harness.admin("stats")["cache"]
    finally:
        harness.stop()
    assert all(o.finish_reason == "length" for o in outs)
    assert stats["device"]["cached"] == 0 and stats["host"]["cached"] == 0, (
        f"pages stayed cached after clear: {stats['device']}, {stats['host']}"
    )
    for node in second.cache.tree.iter_nodes():
        assert node.lock_ref == 0 and node.host_ref == 0, f"a lock nobody holds at {node}"
    given_up = sum(o.cached.disk < len(p) - 2 * 16 for o, p in zip(outs, prompts, strict=True))
    assert given_up > 0, "no load was given up: the test proves nothing"


def test_requests_the_engine_cannot_run_get_a_clear_error(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    engine = _engine(smollm, device_cache_tokens=256)
    engines.append(engine)
    vocab = smollm.config.vocab_size
    cases = {
        "empty": [],
        "token ids must be in": [1, vocab],
        "device cache holds 256": [1] * 300,
    }
    for i, (reason, prompt) in enumerate(cases.items()):
        out = engine.add_request(GenerateRequest(f"bad-{i}", tuple(prompt), GREEDY))
        assert out is not None and out.finished and out.finish_reason == "error"
        assert reason in (out.error or "")
    assert not engine.has_work


def test_warming_up_leaves_the_cache_as_it_was_and_answers_unchanged(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    """`Engine.warm_up` (run at start-up) computes into a private page and frees it."""
    prompt = _prompt(smollm, 2, "What did he hear?")
    cold = _engine(smollm)
    warm = _engine(smollm)
    engines += [cold, warm]
    steps: list[int] = []
    forward = warm.runner.forward

    def counted(batch: ForwardBatch) -> torch.Tensor:
        steps.append(sum(len(ids) for ids in batch.token_ids))
        return forward(batch)

    warm.runner.forward = counted  # type: ignore[method-assign]
    done = warm.warm_up(budget_s=600)  # time enough on any host: every step runs
    warm.runner.forward = forward  # type: ignore[method-assign]
    page = warm.cache_config.page_size
    # The short prompt, one token, the short one again (timed), then prompts growing to one
    # of the largest step (heap and L1 warm), and every L1 page written.
    longest = min(warm.config.max_prefill_tokens, warm.device_tokens, warm.max_model_len - 1)
    assert steps[:3] == [page - 1, 1, page - 1] and steps[-1] == longest > page
    growth = [b / a for a, b in itertools.pairwise(steps[2:])]
    assert steps[3] == (page - 1) * WARM_UP_GROWTH and all(1 < g <= WARM_UP_GROWTH for g in growth)
    assert done.tokens == done.wanted_tokens == longest
    assert done.pages_written == warm.cache.stats().device.total
    stats = warm.cache.stats().device
    assert stats.in_use == 0 and stats.cached == 0 and warm.computed_prompt_tokens == 0
    assert (
        warm.generate([prompt], GREEDY)[0].token_ids == cold.generate([prompt], GREEDY)[0].token_ids
    )


def test_warming_up_stops_at_its_time_budget(smollm: LoadedModel, engines: list[Engine]) -> None:
    """On a slow host start-up takes the budget, not the work: with none left after the
    short prompt, no long prompt runs and the pages are left to fault in on use."""
    engine = _engine(smollm)
    engines.append(engine)
    done = engine.warm_up(budget_s=0.0)
    page = engine.cache_config.page_size
    assert done.tokens == page - 1 < done.wanted_tokens
    assert done.pages_written == 0
    stats = engine.cache.stats().device
    assert stats.in_use == 0 and stats.cached == 0
