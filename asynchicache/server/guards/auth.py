"""Who may call what: the bearer keys of `serve --api-key` and `--admin-api-key`.

    no key                  every route open; every caller is the admin
    --api-key K             every route but /health and /ready wants K; K is the admin
    --admin-api-key A       the admin routes (ADMIN_PATHS: clear, pin, unpin, and SGLang's
                            /flush_cache and /clear_hicache_storage_backend) want A;
                            A opens every route K opens (K: none or --api-key's)

The admin of a request (`is_admin`) may use the admin routes; /cache/stats lists pins
and their owners to the admin only.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from asynchicache.server.errors import APIError

PUBLIC_PATHS = frozenset({"/health", "/ready"})
# SGLang's two cache-dropping routes (server/compat_routes.py) are an operator's act too.
ADMIN_PATHS = frozenset({
    "/cache/clear", "/cache/pin", "/cache/unpin", "/flush_cache", "/clear_hicache_storage_backend",
})  # fmt: skip
ADMIN_SCOPE_KEY = "asynchicache.admin"  # set on every request's ASGI scope by the middleware


def is_admin(request: Request) -> bool:
    """Whether the request holds the keys of the admin routes (see the module docstring)."""
    return bool(request.scope.get(ADMIN_SCOPE_KEY, True))


class APIKeyMiddleware:
    """Rejects requests without the right bearer token (plain ASGI: streams pass untouched).

    `api_key` guards every path but `PUBLIC_PATHS`; `admin_api_key`, when set,
    replaces it on `ADMIN_PATHS` (clearing or pinning the cache is an operator's
    act, not a client's) and opens the other paths as well. None: that key is not
    required. Marks the scope with whether the caller is the admin.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key is not None else None
        self._admin_key = admin_api_key.encode() if admin_api_key is not None else None

    def _roles(self, scope: Scope) -> tuple[bool, bool]:
        """(may use the client routes, may use the admin routes)."""
        token = _bearer(scope)
        user = self._key is None or (token is not None and hmac.compare_digest(token, self._key))
        if self._admin_key is None:
            return user, user
        admin = token is not None and hmac.compare_digest(token, self._admin_key)
        return user or admin, admin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        user, admin = self._roles(scope)
        scope[ADMIN_SCOPE_KEY] = admin
        needs_admin = scope["path"] in ADMIN_PATHS
        if scope["path"] in PUBLIC_PATHS or (admin if needs_admin else user):
            await self.app(scope, receive, send)
            return
        what = "admin API key" if needs_admin and self._admin_key is not None else "API key"
        err = APIError(
            401,
            f"Incorrect or missing {what}; send 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
        )
        await err.response()(scope, receive, send)


def _bearer(scope: Scope) -> bytes | None:
    """The bearer token of the request's Authorization header (None: none)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None
