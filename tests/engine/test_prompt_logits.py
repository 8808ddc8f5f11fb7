"""A prompt seen again draws its first token from its kept last-position logits, before
any forward, and then gives exactly the tokens a recompute gives."""

from __future__ import annotations

import torch

from asynchicache.common.keys import Namespace
from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import AdminRequest, GenerateRequest, SamplingParams
from asynchicache.engine.request import Request
from asynchicache.engine.sampling.prompt_logits import MIB, PromptLogits
from asynchicache.model.loader import LoadedModel
from asynchicache.settings.config import CacheConfig, EngineConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TEXT = "The keeper logged the weather, the ships that passed and the colour of the sea. "


def _prompt(model: LoadedModel, repeats: int = 4, question: str = "What did he log?") -> list[int]:
    tok = model.tokenizer
    messages = [{"role": "user", "content": TEXT * repeats + question}]
    return tok.encode(tok.apply_chat_template(messages))


def _engine(model: LoadedModel, made: list[Engine], mib: int = 64, prefix: bool = True) -> Engine:
    cache = CacheConfig(disk_cache_dir=None, host_cache_gb=0.0, enable_prefix_cache=prefix)
    engine = Engine(EngineConfig(prompt_logits_mib=mib), cache, loaded=model)
    made.append(engine)
    return engine


def _forwards(engine: Engine) -> int:
    return int(engine.tracer.totals.forwards)


def test_a_repeat_draws_its_first_token_before_any_forward_and_gives_the_recomputed_tokens(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    plain, cached = _engine(smollm, engines, prefix=False), _engine(smollm, engines)
    prompt = _prompt(smollm)
    assert len(prompt) % cached.cache_config.page_size != 0  # a partial last page to compute
    expected = plain.generate([prompt], GREEDY)[0].token_ids
    assert cached.generate([prompt], GREEDY)[0].token_ids == expected
    assert cached.prompt_logits.stats().stored == 1

    cached.add_request(GenerateRequest("again", tuple(prompt), GREEDY))
    before = _forwards(cached)
    outputs = cached.step()  # the first token alone: no forward in this step
    assert [o.token_ids for o in outputs] == [expected[:1]]
    assert _forwards(cached) == before
    while cached.has_work:
        outputs += cached.step()
    assert tuple(t for o in outputs if o.rid == "again" for t in o.token_ids) == expected
    trace = cached.tracer.traces()[-1]
    assert trace.rid == "again" and trace.steps == 0 and trace.computed_tokens == 0
    assert cached.prompt_logits.stats().hits == 1
    # Usage: the prompt's full pages came from L1; the tail was computed (after the token).
    again = cached.generate([prompt], GREEDY)[0]
    page = cached.cache_config.page_size
    assert again.token_ids == expected
    assert len(prompt) // page * page <= again.cached.device <= len(prompt)


def test_a_one_token_answer_needs_no_forward_at_all(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    cached = _engine(smollm, engines)
    prompt = _prompt(smollm, 3)
    expected = cached.generate([prompt], GREEDY)[0].token_ids
    before = _forwards(cached)
    one = cached.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert one.token_ids == expected[:1] and one.finish_reason == "length"
    assert one.cached.device == len(prompt)  # no prompt token was computed
    stop = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(expected[0],))
    stopped = cached.generate([prompt], stop)[0]
    assert stopped.token_ids == expected[:1] and stopped.finish_reason == "stop"
    assert _forwards(cached) == before and cached.prompt_logits.stats().hits == 2


def test_seeded_draws_and_logprobs_are_a_recomputes(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    plain, cached = _engine(smollm, engines, prefix=False), _engine(smollm, engines)
    prompt = _prompt(smollm, 5)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.95, seed=7, logprobs=3,
                            ignore_eos=True, repetition_penalty=1.2)  # fmt: skip
    expected = plain.generate([prompt], seeded)[0]
    cached.generate([prompt], seeded)
    again = cached.generate([prompt], seeded)[0]
    assert cached.prompt_logits.stats().hits == 1
    assert again.token_ids == expected.token_ids
    # The logprobs an early answer reports: the kept row's, within float32 noise of a
    # recompute's (here the cold prefill's against the plain engine's).
    asking = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    fresh = plain.generate([prompt], asking)[0].logprobs[0]
    early = cached.generate([prompt], asking)[0].logprobs[0]
    assert cached.prompt_logits.stats().hits == 2
    assert early.token_id == fresh.token_id and early.top_ids == fresh.top_ids
    for ours, theirs in zip(early.top_logprobs, fresh.top_logprobs, strict=True):
        assert abs(ours - theirs) < 1e-4


def test_not_used_across_salts_after_a_clear_or_where_more_than_the_logits_is_needed(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    cached = _engine(smollm, engines)
    prompt = _prompt(smollm, 2)
    cached.generate([prompt], GREEDY, salt="tenant-a")
    stats = cached.prompt_logits.stats
    cached.generate([prompt], GREEDY, salt="tenant-b")  # another tenant: a miss
    assert stats().hits == 0 and stats().entries == 2
    cached.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1), salt="tenant-a")
    assert stats().hits == 0  # prompt logprobs need every position's logits
    group = GenerateRequest("n2", tuple(prompt), GREEDY, "tenant-a", n=2)
    assert cached.add_request(group) is None
    while cached.has_work:
        cached.step()
    assert stats().hits == 0  # a group's members fork from the leader's forward
    reply = cached.admin(AdminRequest("c", "clear", cache_salt="tenant-a", tiers=("device",)))
    assert reply.ok
    assert stats().entries == 1  # tenant-b's stays
    cached.generate([prompt], GREEDY, salt="tenant-a")
    assert stats().hits == 0
    cached.generate([prompt], GREEDY, salt="tenant-b")
    assert stats().hits == 1


def test_off_when_asked_or_without_the_prefix_cache(
    smollm: LoadedModel, engines: list[Engine]
) -> None:
    prompt = _prompt(smollm, 1)
    for engine in (_engine(smollm, engines, mib=0), _engine(smollm, engines, prefix=False)):
        engine.generate([prompt], GREEDY)
        engine.generate([prompt], GREEDY)
        assert engine.prompt_logits.stats().entries == 0
        assert engine.prompt_logits.stats().hits == 0


def test_rows_are_bounded_in_bytes_least_recently_used_out_first() -> None:
    kept = PromptLogits(Namespace("fp", "float32", 16), budget_mib=1)
    row = torch.zeros(MIB // 4 // 3 + 1)  # a third of a MiB and a bit: two fit, not three
    reqs = [Request(f"r{i}", [1, 2, i], SamplingParams()) for i in range(3)]
    kept.put(reqs[0], row)
    kept.put(reqs[1], row)
    assert kept.get(reqs[0]) is not None  # r0 used: r1 is the least recently used now
    kept.put(reqs[2], row)
    assert [kept.get(r) is not None for r in reqs] == [True, False, True]
    assert kept.stats().bytes <= MIB and kept.stats().entries == 2
    kept.put(reqs[1], torch.zeros(MIB // 4 + 1))  # larger than the budget: not kept
    assert kept.stats().entries == 2
    assert kept.name([1, 2], "a") != kept.name([1, 2], "b") != kept.name([1, 2, 0], "a")
    assert kept.clear() == 2 and kept.stats().bytes == 0
