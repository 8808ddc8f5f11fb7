"""Sampling per request (greedy, temperature, top-k, top-p, seeds) and stop checks."""

from __future__ import annotations

import pytest
import torch

from asynchicache.engine.protocol import SamplingParams
from asynchicache.engine.sampler import request_generator, sample

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
    from asynchicache.engine.sampler import pick

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
    from asynchicache.engine.penalties import apply_penalties

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
    from asynchicache.engine.sampler import pick

    row = torch.tensor([[5.0, 4.9, 0.0]])
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    assert pick(row, [params], [None], [([2], [0])])[0].token == 1
    assert pick(row, [SamplingParams(temperature=0)], [None], [([2], [0])])[0].token == 0
