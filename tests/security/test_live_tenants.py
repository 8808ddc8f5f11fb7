"""Issue 22, findings 2 and 10, on a live server (conftest.py: --api-key and
--admin-api-key, a disk tier).

A tenant's `cache_salt` appears nowhere another key holder (or the operator) can read
it: not in /cache/stats (which listed every pin's salt to any user key), /metrics,
pin and clear answers, error messages, the server's log or the pin files. Pins are
listed, with a keyed fingerprint of their owner, to the admin key only; the admin key
opens /cache/stats and /metrics (it got 401 there). A lookup reads only the namespace
the caller names: without the salt, the tenant's prefix is not there.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

import httpx
import pytest
from keyed_server import ADMIN_KEY, KEY, auth
from live_server import LiveServer
from traffic import make_prompts

from asynchicache.launch.frontend import Frontend

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SALT = "tenant-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def secret_prompt(frontend: Frontend) -> list[int]:
    return list(make_prompts(frontend.tokenizer, "secret", 1, lines=12)[0].ids)


@pytest.fixture(scope="module")
def answers(server: LiveServer, secret_prompt: list[int]) -> dict[str, httpx.Response]:
    """The tenant's traffic (a completion, then the operator pins it), and what each key
    holder reads afterwards."""
    completion = {"prompt": secret_prompt, "max_tokens": 2, "temperature": 0, "cache_salt": SALT}
    pin = {"prompt": secret_prompt, "cache_salt": SALT, "ttl_s": 600}
    with httpx.Client(base_url=server.url, timeout=600) as http:
        out = {"completion": http.post("/v1/completions", headers=auth(KEY), json=completion)}
        out["pin"] = http.post("/cache/pin", headers=auth(ADMIN_KEY), json=pin)
        out["bad lookup"] = http.post("/cache/lookup", headers=auth(KEY),
                                      json={"prompt": [10**9], "cache_salt": SALT})  # fmt: skip
        out["bad pin"] = http.post("/cache/pin", headers=auth(ADMIN_KEY),
                                   json={"prompt": [1, 2], "cache_salt": SALT})  # fmt: skip
        for who, key in (("user", KEY), ("admin", ADMIN_KEY)):
            out[f"stats {who}"] = http.get("/cache/stats", headers=auth(key))
            out[f"metrics {who}"] = http.get("/metrics", headers=auth(key))
        out["clear"] = http.post("/cache/clear", headers=auth(ADMIN_KEY),
                                 json={"scope": ["device"], "cache_salt": SALT})  # fmt: skip
    assert out["completion"].status_code == 200, out["completion"].text
    assert out["pin"].status_code == 200, out["pin"].text
    return out


def test_the_admin_key_opens_stats_and_metrics(answers: dict[str, httpx.Response]) -> None:
    for name in ("stats user", "stats admin", "metrics user", "metrics admin"):
        assert answers[name].status_code == 200, (name, answers[name].status_code)


def test_no_answer_names_the_salt(answers: dict[str, httpx.Response]) -> None:
    for name, r in answers.items():
        assert SALT not in r.text, f"{name} shows the tenant's salt"
    assert answers["bad lookup"].status_code == 400 and answers["bad pin"].status_code == 400


def test_pins_and_owners_are_listed_to_the_admin_only(
    answers: dict[str, httpx.Response], root: Path
) -> None:
    user = answers["stats user"].json()["pins"]
    admin = answers["stats admin"].json()["pins"]
    assert "pinned" not in user and user["pinned_pages"] >= 1  # counts stay
    (pin,) = [p for p in admin["pinned"] if p["pin_id"] == answers["pin"].json()["pin_id"]]
    key = (root / "kv" / ".tenant-key").read_bytes()  # the folder's, 0600 with the pages
    owner = hmac.new(key, SALT.encode(), hashlib.sha256).hexdigest()[:32]
    assert pin["owner"] == owner == answers["pin"].json()["owner"]
    assert answers["clear"].json()["owner"] == owner
    assert hashlib.sha256(SALT.encode()).hexdigest()[:32] != owner  # keyed: not guessable


def test_neither_the_log_nor_the_disk_holds_the_salt(
    answers: dict[str, httpx.Response], server: LiveServer, root: Path, secret_prompt: list[int]
) -> None:
    log = server.log_tail(10_000_000)
    assert SALT not in log
    assert "[secret0." not in log  # the prompt's text (make_prompts tags every entry)
    assert ", ".join(map(str, secret_prompt[:8])) not in log  # nor its token ids
    pin_files = list((root / "kv").rglob("*.pin"))
    assert pin_files
    for path in pin_files:
        assert SALT not in path.read_text(), path


def test_a_lookup_sees_only_the_namespace_it_names(
    answers: dict[str, httpx.Response], server: LiveServer, secret_prompt: list[int]
) -> None:
    def cached(salt: str | None) -> int:
        body: dict[str, object] = {"prompt": secret_prompt}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(server.url + "/cache/lookup", headers=auth(KEY), json=body, timeout=60)
        r.raise_for_status()
        return sum(r.json()["cached_tokens_by_tier"].values())

    assert cached(SALT) >= 16  # the tenant, who knows its salt, sees its pinned pages
    for other in (None, "", SALT[:-1], SALT.upper()):
        assert cached(other) == 0, other
