"""vllm-router (the PyPI wheel, a real process) routes by our KV events: two of our
servers behind `--policy kv_aware --kv-event-source URL=tcp://...`; a prompt one of them
holds goes to that one, credited (issue 38). A request never scores on another tenant's
salted pages."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from fleet_rig import PAGE, Fleet, fleet, prompt, send, tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with fleet(tmp_path_factory.mktemp("fleet"), flags=("--no-disk-cache",)) as made:
        yield made


def _credited(pair: Fleet, text: str, holder: str, **extra: object) -> int:
    """Route `text` until the router credits `holder` (its events arrive within ~1 s)."""
    deadline = time.monotonic() + 20
    while True:
        decision, usage = pair.route(text, **extra)
        if decision.worker == holder and decision.credited > 0:
            return decision.credited
        assert time.monotonic() < deadline, (decision, usage)
        time.sleep(0.5)


def test_render_gives_the_ids_the_engine_hashes(pair: Fleet) -> None:
    url = pair.instances[0].url
    text = prompt(1, 40)
    rendered = httpx.post(url + "/v1/completions/render", json={"model": "smollm",
                          "prompt": text}, timeout=60).json()  # fmt: skip
    assert [r["token_ids"] for r in rendered] == [tokens(url, text)]
    chat = httpx.post(url + "/v1/chat/completions/render", json={"model": "smollm", "messages":
                      [{"role": "user", "content": text}]}, timeout=60).json()  # fmt: skip
    assert len(chat["token_ids"]) > len(tokens(url, text))  # the template's tokens around it


@pytest.mark.parametrize("holder", [0, 1])
def test_a_prompt_goes_to_the_instance_that_holds_it(pair: Fleet, holder: int) -> None:
    text = prompt(10 + holder)
    owner = pair.instances[holder]
    send(owner.url, text)  # now in its L1 (and announced as medium GPU)
    credited = _credited(pair, text + " and one more question", owner.url)
    n_tokens = len(tokens(owner.url, text))
    assert credited >= (n_tokens // PAGE - 1) * PAGE  # every full page, at L1's full credit
    decision, usage = pair.route(text + " and one more question")
    assert decision.worker == owner.url
    assert usage["device"] >= (n_tokens // PAGE - 1) * PAGE  # and it was served from L1


def test_no_request_scores_on_another_tenants_pages(pair: Fleet) -> None:
    text = prompt(30)
    owner = pair.instances[1]
    send(owner.url, text, cache_salt="tenant-a")  # only tenant a's (salted) pages
    shared = prompt(31)
    send(owner.url, shared)  # a shared prompt: proves the router sees this instance's events
    _credited(pair, shared + " again", owner.url)
    for extra in ({}, {"cache_salt": "tenant-b"}, {"cache_salt": "tenant-a"}):
        decision, _ = pair.route(text + " again", **extra)
        assert decision.credited == 0, (extra, decision)
