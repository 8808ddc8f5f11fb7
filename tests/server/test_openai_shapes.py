"""The OpenAI response shapes of n, best_of, logprobs, echo and prompt lists, against the
fake engine (real sockets, tokenizer and client; see fake_engine.py for its logprobs).

The numbers themselves are checked against transformers with the real model in
test_openai_surface.py; here the framing: indices, parallel lists, offsets, usage.
"""

from __future__ import annotations

import json

import httpx
import openai
from fake_engine import SLOW_SEED
from server_helpers import API_KEY, ThreadServer

from asynchicache.launch.frontend import Frontend

PROMPT = "The quick brown fox jumps over the lazy dog."
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _client(server: ThreadServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _ids(frontend: Frontend, text: str) -> list[int]:
    return frontend.tokenizer.encode(text)


def _text(frontend: Frontend, ids: list[int]) -> str:
    return frontend.tokenizer.decode(ids)


def test_n_choices_and_usage_counts_the_prompt_once(
    server: ThreadServer, frontend: Frontend
) -> None:
    resp = _client(server).completions.create(model="fake-model", prompt=PROMPT, max_tokens=4, n=3)
    ids = _ids(frontend, PROMPT)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert {c.text for c in resp.choices} == {_text(frontend, ids[:4])}
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 3 * 4


def test_best_of_keeps_the_most_likely(server: ThreadServer) -> None:
    # The fake engine makes member 0 the most likely; the client asked no logprobs.
    resp = _client(server).completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=3, n=1, best_of=3
    )
    assert len(resp.choices) == 1 and resp.choices[0].logprobs is None
    assert resp.usage is not None and resp.usage.completion_tokens == 3 * 3


def test_completion_logprobs_shape(server: ThreadServer, frontend: Frontend) -> None:
    resp = _client(server).completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=4, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    ids = _ids(frontend, PROMPT)[:4]
    assert lp.tokens == [frontend.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs == [-0.1] * 4
    assert all(len(top) == 3 for top in lp.top_logprobs)  # 2 alternatives + the chosen one
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets


def test_echo_with_logprobs_and_max_tokens_zero(server: ThreadServer, frontend: Frontend) -> None:
    resp = _client(server).completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    )
    choice = resp.choices[0]
    ids = _ids(frontend, PROMPT)
    assert choice.text == _text(frontend, ids)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None for v in lp.token_logprobs[1:])
    assert resp.usage is not None and resp.usage.completion_tokens == 0


def test_echo_streams_the_prompt_first(server: ThreadServer, frontend: Frontend) -> None:
    chunks = list(
        _client(server).completions.create(
            model="fake-model", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, stream=True
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    ids = _ids(frontend, PROMPT)
    assert texts[0] == _text(frontend, ids)
    assert "".join(texts) == _text(frontend, ids) + _text(frontend, ids[:3])
    first = chunks[0].choices[0].logprobs
    assert first is not None and first.token_logprobs is not None
    assert first.token_logprobs[0] is None and len(first.token_logprobs) == len(ids)
    streamed = [c.choices[0].logprobs for c in chunks[1:] if c.choices and c.choices[0].text]
    assert all(lp is not None and lp.token_logprobs == [-0.1] for lp in streamed)


def test_a_list_of_prompts_gives_a_choice_per_prompt_and_sample(
    server: ThreadServer, frontend: Frontend
) -> None:
    prompts = ["Alpha beta gamma delta.", "One two three four."]
    resp = _client(server).completions.create(model="fake-model", prompt=prompts, max_tokens=2, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for c in resp.choices:
        assert c.text == _text(frontend, _ids(frontend, prompts[c.index // 2])[:2])
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(len(_ids(frontend, p)) for p in prompts)
    assert resp.usage.completion_tokens == 8
    # token-id prompts too, streamed
    id_prompts = [_ids(frontend, p) for p in prompts]
    chunks = list(
        _client(server).completions.create(
            model="fake-model",
            prompt=id_prompts,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {i: _text(frontend, ids[:2]) for i, ids in enumerate(id_prompts)}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_chat_n_and_logprobs_streamed_and_not(server: ThreadServer, frontend: Frontend) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    resp = _client(server).chat.completions.create(
        model="fake-model", messages=messages, max_tokens=3, n=2, logprobs=True, top_logprobs=2
    )  # type: ignore[arg-type]
    assert [c.index for c in resp.choices] == [0, 1]
    for c in resp.choices:
        assert c.logprobs is not None and c.logprobs.content is not None
        assert len(c.logprobs.content) == 3
        for entry in c.logprobs.content:
            assert entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 2
        assert [e.logprob for e in c.logprobs.content] == [-(c.index + 1) / 10] * 3
    stream = _client(server).chat.completions.create(
        model="fake-model", messages=messages, max_tokens=3, n=2, logprobs=True, stream=True
    )  # type: ignore[arg-type]
    content: dict[int, list[float]] = {0: [], 1: []}
    reasons = {}
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                content[c.index] += [e.logprob for e in c.logprobs.content]
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert content == {0: [-0.1] * 3, 1: [-0.2] * 3} and set(reasons) == {0, 1}


def test_stop_string_ends_one_member(server: ThreadServer, frontend: Frontend) -> None:
    resp = _client(server).completions.create(
        model="fake-model", prompt=PROMPT, max_tokens=30, n=2, stop=["lazy"]
    )
    assert [c.finish_reason for c in resp.choices] == ["stop", "stop"]
    assert all(c.text == "The quick brown fox jumps over the " for c in resp.choices)


def test_disconnect_aborts_every_prompt(server: ThreadServer) -> None:
    body = {
        "model": "fake-model",
        "prompt": [PROMPT, PROMPT + " x"],
        "max_tokens": 50,
        "stream": True,
        "seed": SLOW_SEED,
        "n": 2,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
        first = next(ln for ln in r.iter_lines() if ln.startswith("data: "))
    rid = json.loads(first[6:])["id"]
    aborts = server.run_dir / "aborts.txt"
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        seen = aborts.read_text().split() if aborts.exists() else []
        if {f"{rid}-0", f"{rid}-1"} <= set(seen):
            break
        time.sleep(0.05)
    assert {f"{rid}-0", f"{rid}-1"} <= set(seen)


def test_penalties_and_logit_bias_are_accepted(server: ThreadServer) -> None:
    resp = _client(server).completions.create(
        model="fake-model",
        prompt=PROMPT,
        max_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"17": 5.0},
        extra_body={"repetition_penalty": 1.2},
    )
    assert resp.choices[0].finish_reason == "length"
