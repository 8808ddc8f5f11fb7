"""vLLM's /tokenize, /detokenize and /version, SGLang's /flush_cache and
/clear_hicache_storage_backend (server/compat_routes.py), over the real app and tokenizer
(a fake engine process behind them)."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import ADMIN_KEY, API_KEY, ThreadServer

from asynchicache import __version__
from asynchicache.launch.frontend import Frontend

CLIENT = {"Authorization": f"Bearer {API_KEY}"}
OPERATOR = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _post(server: ThreadServer, path: str, body: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=CLIENT, timeout=30)


def test_tokenize_a_prompt_in_vllms_shape(admin_server: ThreadServer, frontend: Frontend) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    r = _post(admin_server, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                          "return_token_strs": True})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    ids = frontend.tokenizer.encode(text, add_special_tokens=False)
    assert body == {"count": len(ids), "max_model_len": body["max_model_len"], "tokens": ids,
                    "token_strs": frontend.tokenizer.token_strs(ids)}  # fmt: skip
    assert body["max_model_len"] > 0 and body["token_strs"][1].startswith("Ġ")
    plain = _post(admin_server, "/tokenize", {"model": "fake-model", "prompt": text}).json()
    assert plain["token_strs"] is None and plain["count"] >= len(ids)


def test_tokenize_messages_applies_the_chat_template(
    admin_server: ThreadServer, frontend: Frontend
) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    body = _post(admin_server, "/tokenize", {"messages": messages}).json()
    text = frontend.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert body["tokens"] == frontend.tokenizer.encode(text, add_special_tokens=False)
    bare = _post(admin_server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare.json()["count"] < body["count"]


def test_detokenize_round_trips(admin_server: ThreadServer) -> None:
    text = "Caching prompts, one page at a time."
    ids = _post(admin_server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    r = _post(admin_server, "/detokenize", {"model": "fake-model", "tokens": ids["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                       "continue_final_message": True}, "continue_final_message"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
        ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ],
)  # fmt: skip
def test_bad_bodies_are_a_clear_4xx(
    admin_server: ThreadServer, path: str, body: dict, param: str
) -> None:
    r = _post(admin_server, path, body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param


def test_version_and_models_as_vllm_reads_them(admin_server: ThreadServer) -> None:
    assert httpx.get(admin_server.url + "/version", headers=CLIENT).json() == {
        "version": __version__
    }
    card = httpx.get(admin_server.url + "/v1/models", headers=CLIENT).json()["data"][0]
    assert card["root"] == card["id"] == "fake-model"  # vLLM's bench reads data[0]["root"]
    assert httpx.get(admin_server.url + "/version").status_code == 401  # the API key still holds


@pytest.mark.parametrize("path", ["/flush_cache", "/clear_hicache_storage_backend"])
def test_sglangs_flushes_want_the_admin_key(admin_server: ThreadServer, path: str) -> None:
    for headers in ({}, CLIENT):
        assert httpx.post(admin_server.url + path, headers=headers).status_code == 401
    r = httpx.post(admin_server.url + path, headers=OPERATOR, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    # A state change a link or an <img> could trigger: POST only (issue 39).
    assert httpx.get(admin_server.url + path, headers=OPERATOR, timeout=30).status_code == 405
    assert "flushed" in r.text.lower() or "cleared" in r.text.lower()
    assert (
        httpx.post(admin_server.url + "/flush_cache?timeout=-1", headers=OPERATOR).status_code
        == 400
    )


def test_the_served_tokenizer_gives_token_strs_too(frontend: Frontend) -> None:
    """`serve` hands the routes `Frontend.bounded_tokenizer`, not the bare one (mypy found
    it lacked `token_strs`: /tokenize with return_token_strs was an AttributeError)."""
    bounded = frontend.bounded_tokenizer(1024)
    ids = frontend.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    assert bounded.token_strs(ids) == frontend.tokenizer.token_strs(ids)
