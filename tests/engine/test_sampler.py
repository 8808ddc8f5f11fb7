"""Sampling per request (greedy, temperature, top-k, top-p, seeds) and stop checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.sampling.sampler import request_generator, sample

VOCAB = 50


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_argmax() -> None:
    logits = logits_rows(4)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1, temperature=0.7)] * 2
    assert sample(logits, params, [None] * 4) == logits.argmax(-1).tolist()


def test_seeded_requests_repeat_whatever_the_batch() -> None:
    logits = logits_rows(3)
    params = SamplingParams(temperature=1.0, seed=7)
    alone = [sample(logits[1:2], [params], [request_generator(7)])[0] for _ in range(3)]
    batched = []
    for trial in range(3):
        others = SamplingParams(temperature=1.3, seed=trial)
        gens = [request_generator(trial), request_generator(7), request_generator(trial + 9)]
        batched.append(sample(logits, [others, params, others], gens)[1])
    assert alone == batched
    gen_a, gen_b = request_generator(7), request_generator(7)
    stream_a = [sample(logits[:1], [params], [gen_a])[0] for _ in range(20)]
    stream_b = [sample(logits[:1], [params], [gen_b])[0] for _ in range(20)]
    assert stream_a == stream_b  # the same seed replays the same stream
    assert len(set(stream_a)) > 1  # the generator advances from step to step


def test_unseeded_generators_differ() -> None:
    a, b = request_generator(None), request_generator(None)
    assert a.initial_seed() != b.initial_seed()


def test_top_k_restricts_to_the_k_best() -> None:
    logits = logits_rows(1, seed=3)
    best3 = set(logits[0].topk(3).indices.tolist())
    gen = request_generator(1)
    params = [SamplingParams(temperature=5.0, top_k=3)]
    drawn = {sample(logits, params, [gen])[0] for _ in range(200)}
    assert drawn == best3


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    gen = request_generator(2)
    drawn = {sample(logits, [SamplingParams(top_p=0.7)], [gen])[0] for _ in range(300)}
    assert drawn == {0, 1}
    drawn = {sample(logits, [SamplingParams(top_p=0.1)], [gen])[0] for _ in range(50)}
    assert drawn == {0}


def test_temperature_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    gen = request_generator(3)
    params = [SamplingParams(temperature=2.0)]
    counts = torch.bincount(
        torch.tensor([sample(logits, params, [gen])[0] for _ in range(3000)]), minlength=3
    )
    expected = (logits / 2.0).softmax(-1)[0] * 3000
    assert torch.allclose(counts.float(), expected, rtol=0.15)


def test_mismatched_lengths_raise() -> None:
    with pytest.raises(ValueError, match="2 logit rows, 1 params"):
        sample(logits_rows(2), [SamplingParams()], [None])


def test_logit_bias_steers_greedy_and_leaves_logprobs_raw() -> None:
    from asynchicache.engine.protocol import LogitBias
    from asynchicache.engine.sampling.sampler import pick

    logits = logits_rows(2, seed=5)
    worst = int(logits[0].argmin())
    biased = SamplingParams(temperature=0, logprobs=2, logit_bias=(LogitBias(worst, 100.0),))
    plain = SamplingParams(temperature=0, logprobs=0)
    picks = pick(logits, [biased, plain], [None, None], [([1], []), ([1], [])])
    assert picks[0].token == worst and picks[1].token == int(logits[1].argmax())
    raw = torch.log_softmax(logits, dim=-1)
    assert picks[0].logprob is not None and picks[1].logprob is not None
    assert picks[0].logprob.logprob == pytest.approx(raw[0, worst].item(), abs=1e-6)
    assert list(picks[0].logprob.top_ids) == raw[0].topk(2).indices.tolist()
    assert picks[1].logprob.top_ids == ()


def test_penalties_follow_openai_and_vllm() -> None:
    from asynchicache.engine.sampling.penalties import apply_penalties

    row = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    prompt, output = [3], [0, 0, 1]
    cases = {
        SamplingParams(presence_penalty=0.5): [1.5, -2.5, 1.0, 0.5, 3.0],
        SamplingParams(frequency_penalty=0.5): [1.0, -2.5, 1.0, 0.5, 3.0],
        SamplingParams(repetition_penalty=2.0): [1.0, -4.0, 1.0, 0.25, 3.0],
    }
    for params, expected in cases.items():
        got = apply_penalties(row, [params], [(prompt, output)])
        assert got[0].tolist() == pytest.approx(expected), params
    assert apply_penalties(row, [SamplingParams()], [(prompt, output)]) is row


def test_penalties_change_what_greedy_picks() -> None:
    from asynchicache.engine.sampling.sampler import pick

    row = torch.tensor([[5.0, 4.9, 0.0]])
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert pick(row, [params], [None], [([2], [0])])[0].token == 1
    assert pick(row, [SamplingParams(temperature=0)], [None], [([2], [0])])[0].token == 0


# ---------------------------------------------------------------- totality
# Whatever SamplingParams accepts, a step must not raise: these values once killed the
# engine ("probability tensor contains either inf, nan or element < 0").


def _valid(token: int, vocab: int) -> bool:
    return 0 <= token < vocab


def test_a_vanishing_top_p_keeps_the_best_token() -> None:
    from asynchicache.engine.sampling.sampler import pick

    logits = logits_rows(3, seed=8)
    for top_p in (1e-50, 5e-324, 1e-8):
        params = [SamplingParams(top_p=top_p, temperature=1.0)] * 3
        gens = [request_generator(i) for i in range(3)]
        picks = pick(logits, params, gens, [([1], [])] * 3)
        assert [p.token for p in picks] == logits.argmax(-1).tolist(), top_p


def test_extreme_repetition_penalties_still_pick_a_token() -> None:
    from asynchicache.engine.sampling.sampler import pick

    logits = logits_rows(2, seed=9)
    seen = (list(range(VOCAB)), [1, 2, 3])  # every token seen: every logit is penalized
    for penalty in (0.01, 100.0):
        for temperature in (0.0, 1.0):
            params = [SamplingParams(repetition_penalty=penalty, temperature=temperature)] * 2
            picks = pick(logits, params, [request_generator(1), None], [seen, seen])
            assert all(_valid(p.token, VOCAB) for p in picks), (penalty, temperature)


def test_a_tiny_temperature_is_finite() -> None:
    from asynchicache.engine.sampling.sampler import pick

    for temperature, scale in ((1e-300, 1.0), (1e-5, 1e34)):  # logits / T overflow float32
        logits = logits_rows(2, seed=10) * scale
        params = [SamplingParams(temperature=temperature, logprobs=2)] * 2
        gens = [request_generator(3), request_generator(4)]
        picks = pick(logits, params, gens, [([1], [])] * 2)
        assert [p.token for p in picks] == logits.argmax(-1).tolist()
        assert all(p.logprob is not None and math.isfinite(p.logprob.logprob) for p in picks)


def test_non_finite_logits_still_pick_a_token() -> None:
    from asynchicache.engine.sampling.sampler import pick

    logits = logits_rows(4, seed=11)
    logits[0, 3] = float("inf")
    logits[1, :] = float("-inf")
    logits[2, 5] = float("nan")
    logits[3, :] = float("nan")
    params = [SamplingParams(temperature=1.0, top_p=0.5, logprobs=1)] * 4
    gens = [request_generator(i) for i in range(4)]
    picks = pick(logits, params, gens, [([1], [2])] * 4)
    assert all(_valid(p.token, VOCAB) for p in picks)
    assert picks[0].token == 3
    assert all(p.logprob is not None and math.isfinite(p.logprob.logprob) for p in picks)


def test_min_p_keeps_tokens_near_the_best() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    gen = request_generator(5)
    params = [SamplingParams(min_p=0.25)]  # keeps p >= 0.125: tokens 0, 1, 2
    drawn = {sample(probs.log(), params, [gen])[0] for _ in range(300)}
    assert drawn == {0, 1, 2}
    assert {sample(probs.log(), [SamplingParams(min_p=1.0)], [gen])[0] for _ in range(50)} == {0}


_TINY = [5e-324, 1e-308, 1e-50, 1e-5]
_TEMPERATURES = st.sampled_from([0.0, *_TINY, 0.5, 2.0, 1e308])
_UNIT = st.sampled_from([*_TINY, 0.5, 1.0])  # top_p, min_p


@st.composite
def _params(draw: st.DrawFn) -> SamplingParams:
    """SamplingParams from extreme numbers; those SamplingParams refuses are skipped."""
    from asynchicache.engine.protocol import LogitBias

    fields = {
        "temperature": draw(_TEMPERATURES),
        "top_p": draw(_UNIT),
        "top_k": draw(st.sampled_from([0, 1, 2, VOCAB, 2**31 - 1, 10**30])),
        "presence_penalty": draw(st.sampled_from([-2.0, 0.0, 1e-308, 2.0])),
        "frequency_penalty": draw(st.sampled_from([-2.0, 0.0, 2.0])),
        # 1e-308 is refused now; it once reached the sampler and killed the engine.
        "repetition_penalty": draw(st.sampled_from([1e-308, 0.01, 0.5, 1.0, 2.0, 100.0])),
        "logit_bias": tuple(
            LogitBias(t, b)
            for t, b in draw(
                st.dictionaries(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, 100.0]))
            ).items()
        ),
        "logprobs": draw(st.sampled_from([None, 0, 20])),
        "seed": draw(st.sampled_from([None, 0, -(2**63), 2**64 - 1])),
    }
    min_p = draw(st.none() | st.just(0.0) | _UNIT)
    if min_p is not None:
        fields["min_p"] = min_p
    try:
        return SamplingParams(**fields)
    except ValueError:
        assume(False)
        raise


@settings(max_examples=60, deadline=None)
@given(_params(), st.sampled_from([1.0, 1e4, 1e30]), st.integers(0, 2**16))
def test_every_valid_sampling_params_picks_a_token(
    params: SamplingParams, scale: float, seed: int
) -> None:
    from asynchicache.engine.sampling.sampler import pick

    logits = logits_rows(2, seed=seed) * scale
    gens = [request_generator(params.seed), request_generator(params.seed)]
    history = (list(range(0, VOCAB, 2)), [1, 3, 3])
    picks = pick(logits, [params, params], gens, [history, history])
    assert all(_valid(p.token, VOCAB) for p in picks)
    for p in picks:
        if params.logprobs is not None:
            assert p.logprob is not None and math.isfinite(p.logprob.logprob)
