"""Our connector under vLLM's real schedulers: async scheduling and speculative decoding.

vLLM's `Scheduler` and `AsyncScheduler` (sched_harness.py: no GPU, a fake
model that writes K/V encoding each position's input token) plan our saves.
Under async scheduling `all_token_ids` lags the computed count; with
speculative decoding draft tokens are scheduled (and computed) before they are
accepted. A page is saved only when every token in it is known and accepted:
every page in L2 must hold the K/V of the accepted tokens, and a later request
that loads them must get exactly those. On main (27901ab) the first async or
speculative step killed vLLM's engine core (IndexError in
build_connector_meta).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from sched_harness import BLOCK, PAGE, Engine, Truth, page_is_truth, tiny_model_folder

from asynchicache.integrations.vllm.block_lookup import RequestChain

pytestmark = pytest.mark.timeout(600)

MODES = {
    "async": {"async_scheduling": True},
    "spec4": {"spec_tokens": 4},
    "async-spec2": {"async_scheduling": True, "spec_tokens": 2},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("sched-model"))


@pytest.fixture(scope="module", params=list(MODES))
def engine(
    request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    """One engine per mode for the module (tests keep apart by their request ids and
    tokens)."""
    made = Engine(model, tmp_path_factory.mktemp(request.param), **MODES[request.param])
    yield made
    made.shutdown()


def truth(seed: int, prompt: int, output: int) -> Truth:
    rng = random.Random(seed)
    return Truth(
        [rng.randrange(1, 900) for _ in range(prompt)],
        [rng.randrange(1, 900) for _ in range(output)],
    )


def names(engine: Engine, tokens: list[int]) -> list[bytes]:
    return RequestChain(engine.side.namespace.digest(), PAGE).extend(tokens)


def all_names(engine: Engine) -> set[bytes]:
    """The names of every page of accepted tokens of every request the engine ran."""
    return {h for t in engine.truths.values() for h in names(engine, t.prompt + t.continuation)}


def test_saved_pages_hold_only_accepted_tokens_kv(engine: Engine) -> None:
    # 47 prompt tokens: the first decode step computes token 48, which completes
    # page 3 while all_token_ids (async) still has 47, or holds drafts (spec).
    t = truth(1, 47, 60)
    engine.add("r1", t, max_tokens=60)
    engine.run()
    assert engine.finished["r1"].finish_reason is not None
    full = t.prompt + t.continuation[:59]  # the last sampled token is never computed
    chain = names(engine, full)
    in_l2 = engine.l2_pages()
    saved = [i for i, h in enumerate(chain) if h in in_l2]
    # every page of accepted tokens whose KV was computed while the request ran
    assert len(saved) >= len(full) // PAGE - 1, (saved, len(chain))
    wrong = [i for i in saved if not page_is_truth(in_l2[chain[i]], t, i)]
    assert wrong == [], f"pages {wrong} hold K/V of tokens that were not accepted"
    # nothing else was saved: no page named by draft tokens
    assert set(in_l2) <= all_names(engine)
    engine.settle()


def test_a_later_request_loads_exactly_the_accepted_kv(engine: Engine) -> None:
    first = truth(2, 70, 50)
    engine.add("first", first, max_tokens=50)
    engine.run()
    engine.scheduler.reset_prefix_cache()  # vLLM's own cache forgets: only ours serves
    # The same prefix and more: prompt + the first answer + new tokens.
    prompt = first.prompt + first.continuation[:45] + [7, 8, 9]
    again = Truth(prompt, [11] * 8)
    req = engine.add("again", again, max_tokens=4)
    engine.step()  # the lookup
    for _ in range(40):
        if req.num_computed_tokens:
            break
        engine.step()
    hit = req.num_computed_tokens - (req.num_output_placeholders or 0)
    assert hit >= (len(prompt) - 1) // PAGE * PAGE - PAGE, hit
    blocks = engine.scheduler.kv_cache_manager.get_block_ids("again")[0]
    assert (
        engine.model.wrong_positions(blocks, again, min(hit, (len(prompt) - 1) // PAGE * PAGE))
        == []
    )
    engine.run()
    engine.settle()


def test_chunked_prefill_saves_each_chunks_pages(model: Path, tmp_path: Path) -> None:
    """A prompt longer than a step's token budget: each chunk's full pages are saved in
    the step that computed them, none past the chunk."""
    made = Engine(model, tmp_path, async_scheduling=True, max_batched_tokens=2 * BLOCK + 5)
    try:
        t = truth(3, 5 * BLOCK + 3, 4)
        made.add("long", t, max_tokens=4)
        made.run()
        chain = names(made, t.prompt)
        in_l2 = made.l2_pages()
        assert all(h in in_l2 and page_is_truth(in_l2[h], t, i) for i, h in enumerate(chain))
    finally:
        made.shutdown()


def test_tensor_parallel_ranks_save_and_load_their_own_heads(model: Path, tmp_path: Path) -> None:
    """TP 2 (vLLM's scheduler, two ranks' workers over their own blocks, their outputs
    aggregated as vLLM's executor does): a page holds both ranks' heads, each in its own
    slice, published only once both copied; a later request loads each rank's heads back
    into that rank's blocks."""
    made = Engine(model, tmp_path, async_scheduling=True, tp=2)
    try:
        assert made.side.namespace.engine.endswith("/tp2")
        first = truth(4, 3 * BLOCK + 5, 20)
        made.add("tp-first", first, max_tokens=20)
        made.run()
        made.settle()
        chain = names(made, first.prompt)
        in_l2 = made.l2_pages()
        assert all(page_is_truth(in_l2[h], first, i, tp=2) for i, h in enumerate(chain))
        made.scheduler.reset_prefix_cache()
        again = Truth([*first.prompt, 9], [3, 4])
        req = made.add("tp-again", again, max_tokens=2)
        for _ in range(40):
            made.step()
            if req.num_computed_tokens:
                break
        loaded = len(chain) * PAGE
        blocks = made.scheduler.kv_cache_manager.get_block_ids("tp-again")[0]
        for rank_model in made.models:  # each rank got its own heads back
            assert rank_model.wrong_positions(blocks, again, loaded) == []
        made.run()
        made.settle()
        assert made.hit_tokens() == loaded
    finally:
        made.shutdown()
