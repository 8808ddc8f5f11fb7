"""The OpenAI surface on a real server (`python -m asynchicache serve`, SmolLM2, the
official `openai` client): request groups (n, best_of), logprobs checked against
transformers, echo with prompt logprobs past a fully cached prompt, prompt lists,
penalties and logit_bias.

One server per module and mode, started together: the prefix-cache server serves
every test, a second one with `--no-prefix-cache` only the group tests whose page
sharing depends on it (prefill once and release, disconnect).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from hf_reference import hf_logprobs
from serve_process import ServeProcess, disk_server, shutdown_together, start_together

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOP = 5
STORY = (
    "The lighthouse keeper wrote in his log every evening: the weather, the ships that "
    "passed, the birds that rested on the rail, and the colour of the sea at dusk."
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, ...]]:
    """The prefix-cache server and the `--no-prefix-cache` one, started together."""
    root = tmp_path_factory.mktemp("surface")
    prefix = disk_server(root / "kv", root / "prefix-cache.log")
    plain = disk_server(
        root / "unused", root / "no-prefix-cache.log", "--no-prefix-cache", "--no-disk-cache"
    )
    try:
        start_together([prefix, plain])
        yield prefix, plain
    finally:
        shutdown_together([prefix, plain])


@pytest.fixture(scope="module")
def server(servers: tuple[ServeProcess, ...]) -> ServeProcess:
    return servers[0]


@pytest.fixture(scope="module")
def plain_server(servers: tuple[ServeProcess, ...]) -> ServeProcess:
    return servers[1]


@pytest.fixture(params=["prefix-cache", "no-prefix-cache"])
def either_server(request: pytest.FixtureRequest) -> ServeProcess:
    """The group tests whose page sharing differs without the prefix cache run on both."""
    name = "server" if request.param == "prefix-cache" else "plain_server"
    return request.getfixturevalue(name)


def _client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(server: ServeProcess, content: str, **kwargs: Any) -> Any:
    """A chat completion of one user message (`kwargs`: the request's other fields)."""
    messages = [{"role": "user", "content": content}]
    return _client(server).chat.completions.create(model=MODEL, messages=messages, **kwargs)


def _stats(server: ServeProcess) -> dict[str, Any]:
    """Stats with an integrity scan (waiting out the scans' rate limit: 429, Retry-After)."""
    while True:
        r = httpx.get(server.url + "/cache/stats", params={"integrity": "true"}, timeout=30)
        if r.status_code != 429:
            return r.json()
        time.sleep(float(r.headers.get("Retry-After", "1")))


@pytest.fixture(scope="module")
def tok(frontend: Any) -> Any:
    return frontend.tokenizer


def assert_idle_and_released(server: ServeProcess) -> None:
    """Every member ended: no request running, no private page, no lock, tree intact."""
    deadline = time.monotonic() + 30
    while True:
        stats = _stats(server)
        idle = not any(stats["queues"].values())  # waiting, loading, running, given-up loads
        if idle and stats["cache_lock_refs"] == 0 and stats["cache"]["device"]["in_use"] == 0:
            break
        assert time.monotonic() < deadline, f"not released: {stats['queues']}, {stats['cache']}"
        time.sleep(0.1)
    assert stats["integrity"]["ok"], stats["integrity"]


# ------------------------------------------------------------------- groups
def test_seeded_samples_differ_and_repeat(server: ServeProcess) -> None:
    def four() -> list[str]:
        resp = _client(server).completions.create(
            model=MODEL, prompt=STORY, max_tokens=12, temperature=0.8, n=4, seed=77
        )
        assert [c.index for c in resp.choices] == [0, 1, 2, 3]
        return [c.text for c in resp.choices]

    first = four()
    assert len(set(first)) == 4
    assert four() == first
    assert_idle_and_released(server)


def test_greedy_members_equal_n1_over_one_prefill(either_server: ServeProcess, tok: Any) -> None:
    server = either_server
    prompt = f"Question {time.monotonic_ns()}: {STORY} What did he write?"  # cold
    n_prompt = len(tok.encode(prompt))
    before = _stats(server)["computed_prompt_tokens"]
    greedy = {"max_tokens": 10, "temperature": 0, "extra_body": {"ignore_eos": True}}
    three = _client(server).completions.create(model=MODEL, prompt=prompt, n=3, **greedy)
    computed = _stats(server)["computed_prompt_tokens"] - before
    assert three.usage is not None and three.usage.prompt_tokens == n_prompt
    assert three.usage.prompt_tokens_details is not None
    assert three.usage.prompt_tokens_details.cached_tokens == 0
    assert computed == n_prompt  # one prefill for three members
    assert three.usage.completion_tokens == 3 * 10
    one = _client(server).completions.create(model=MODEL, prompt=prompt, **greedy)
    assert [c.text for c in three.choices] == [one.choices[0].text] * 3
    assert_idle_and_released(server)


def test_cached_tokens_count_the_prompt_once(server: ServeProcess) -> None:
    messages = [{"role": "user", "content": f"{STORY * 4} Summarize."}]
    client = _client(server)
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    again = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, n=3, temperature=0.7, seed=5
    )  # type: ignore[arg-type]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= again.usage.prompt_tokens  # once, not three times
    assert len(again.choices) == 3
    assert_idle_and_released(server)


def test_streamed_group_and_usage(server: ServeProcess) -> None:
    stream = _chat(
        server,
        "Name three colours.",
        max_tokens=8,
        n=3,
        temperature=0.9,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert set(texts) == set(reasons) == {0, 1, 2}
    assert usage is not None and usage.completion_tokens >= 3
    assert_idle_and_released(server)


def test_disconnect_mid_stream_frees_every_member(either_server: ServeProcess) -> None:
    server = either_server
    body = {
        "model": MODEL,
        "prompt": STORY,
        "max_tokens": 400,
        "n": 4,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        seen = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.add(httpx.Response(200, content=line[6:]).json()["choices"][0]["index"])
            if len(seen) == 4:
                break
    assert seen == {0, 1, 2, 3}
    assert_idle_and_released(server)


def test_best_of_keeps_the_most_likely(server: ServeProcess) -> None:
    args = {"model": MODEL, "prompt": STORY, "max_tokens": 6, "temperature": 1.0, "seed": 11}
    client = _client(server)
    every = client.completions.create(**args, n=3, logprobs=0)
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]  # type: ignore[union-attr,arg-type]
    best = client.completions.create(**args, n=1, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == every.choices[sums.index(max(sums))].text
    assert_idle_and_released(server)


# ----------------------------------------------------------------- logprobs
def _hf_greedy(hf: Any, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def assert_top_matches(tok: Any, top: dict[str, float], row: torch.Tensor, k: int) -> None:
    """The k alternatives (the dict's first k entries) in the reference's order."""
    values, ids = row.topk(k)
    entries = list(top.items())[:k]
    for i, (text, lp) in enumerate(entries):
        assert abs(lp - values[i].item()) < 1e-3
        if text != tok.decode([int(ids[i])], skip_special_tokens=False):
            # only alternatives within 1e-6 of each other may swap places
            assert (
                abs(values[i].item() - values[min(i + 1, k - 1)].item()) < 1e-6
                or abs(values[i].item() - values[max(i - 1, 0)].item()) < 1e-6
            )


def test_completion_logprobs_match_transformers(
    server: ServeProcess, hf_smollm: Any, tok: Any
) -> None:
    prompt = tok.encode(STORY)
    resp = _client(server).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        logprobs=TOP,
        extra_body={"ignore_eos": True},
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    generated = _hf_greedy(hf_smollm, prompt, 8)
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in generated]
    ref = hf_logprobs(hf_smollm, prompt + generated)
    assert len(lp.token_logprobs) == 8
    for i, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert value is not None and abs(value - row.max().item()) < 1e-3  # greedy: the top
        assert top is not None
        assert_top_matches(tok, top, row, TOP)


def test_echo_prompt_logprobs_bypass_a_cached_prompt(
    server: ServeProcess, hf_smollm: Any, tok: Any
) -> None:
    text = f"{STORY} Entry {time.monotonic_ns()}."
    prompt = tok.encode(text)
    client = _client(server)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    lookup = httpx.post(server.url + "/cache/lookup", json={"prompt": prompt}).json()
    page = 16
    assert lookup["cached_tokens_by_tier"]["device"] >= (len(prompt) - 1) // page * page
    before = _stats(server)["computed_prompt_tokens"]
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=TOP
    )
    assert _stats(server)["computed_prompt_tokens"] - before == len(prompt)
    choice = resp.choices[0]
    assert choice.text == tok.decode(prompt)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_logprobs(hf_smollm, prompt)
    for j in range(1, len(prompt)):
        value, top = lp.token_logprobs[j], lp.top_logprobs[j]
        assert value is not None and abs(value - ref[j - 1, prompt[j]].item()) < 1e-3
        assert top is not None
        assert_top_matches(tok, top, ref[j - 1], TOP)
    assert resp.usage is not None and resp.usage.completion_tokens == 0
    assert_idle_and_released(server)


def test_chat_logprobs_shape_and_values(server: ServeProcess) -> None:
    resp = _chat(server, "Say hello.", max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == resp.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)


# -------------------------------------------------- prompt lists, penalties
def test_prompt_list_equals_single_requests(server: ServeProcess) -> None:
    prompts = ["The capital of France is", "Two plus two equals"]
    client = _client(server)
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
        for p in prompts
    ]
    assert [c.text for c in both.choices] == [s.choices[0].text for s in singles]
    assert both.usage is not None
    assert both.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)  # type: ignore[union-attr]


def test_logit_bias_and_penalties_steer_greedy(server: ServeProcess, tok: Any) -> None:
    client = _client(server)
    target = tok.encode(" banana")[0]
    biased = client.completions.create(
        model=MODEL,
        prompt="My favourite fruit is",
        max_tokens=3,
        temperature=0,
        logit_bias={str(target): 100},
        logprobs=0,
    )
    lp = biased.choices[0].logprobs
    assert lp is not None and lp.tokens == [tok.decode([target])] * 3
    plain = client.completions.create(
        model=MODEL, prompt="one one one one one", max_tokens=8, temperature=0
    )
    penalized = client.completions.create(
        model=MODEL,
        prompt="one one one one one",
        max_tokens=8,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
        extra_body={"repetition_penalty": 1.5},
    )
    assert penalized.choices[0].text != plain.choices[0].text
    assert_idle_and_released(server)


def test_server_log_is_clean(either_server: ServeProcess) -> None:
    log = Path(either_server.log_path).read_text(errors="replace")
    assert "Traceback" not in log, log[log.index("Traceback") - 200 :][:3000]
