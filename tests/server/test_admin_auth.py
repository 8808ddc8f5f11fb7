"""`--admin-api-key`: the routes that drop or pin cache contents want the operator's key."""

from __future__ import annotations

import asyncio

import httpx
from server_helpers import ADMIN_KEY, API_KEY, ThreadServer
from starlette.responses import PlainTextResponse

from asynchicache.server.api import APIKeyMiddleware


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_clear_wants_the_admin_key_not_the_api_key(admin_server: ThreadServer) -> None:
    url = admin_server.url + "/cache/clear"
    for headers in ({}, _auth(API_KEY), _auth("wrong")):
        r = httpx.post(url, headers=headers)
        assert r.status_code == 401, headers
        assert "admin API key" in r.json()["error"]["message"]
    assert httpx.post(url, headers=_auth(ADMIN_KEY)).status_code == 200


def test_client_routes_want_a_key_and_the_admin_key_opens_them_too(
    admin_server: ThreadServer,
) -> None:
    """Issue 22, finding 10: the admin key got 401 on /cache/stats and /metrics."""
    for path in ("/cache/stats", "/metrics", "/v1/models"):
        url = admin_server.url + path
        assert httpx.get(url, headers=_auth(API_KEY)).status_code == 200, path
        assert httpx.get(url, headers=_auth(ADMIN_KEY)).status_code == 200, path
        assert httpx.get(url, headers=_auth("wrong")).status_code == 401, path
        assert httpx.get(url).status_code == 401, path
    assert httpx.get(admin_server.url + "/health").status_code == 200


def test_admin_key_alone_guards_only_the_admin_routes() -> None:
    # One engine serves one HTTP app, so this case runs the middleware over a bare app.
    async def ok(scope: dict, receive: object, send: object) -> None:
        await PlainTextResponse("ok")(scope, receive, send)  # type: ignore[arg-type]

    app = APIKeyMiddleware(ok, api_key=None, admin_api_key=ADMIN_KEY)  # type: ignore[arg-type]

    async def run() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [
                (await client.get("/cache/stats")).status_code,
                (await client.post("/cache/clear")).status_code,
                (await client.post("/cache/pin", headers=_auth(API_KEY))).status_code,
                (await client.post("/cache/clear", headers=_auth(ADMIN_KEY))).status_code,
            ]

    assert asyncio.run(run()) == [200, 401, 401, 200]
