"""`ExposureGuard`: who may change the server's state, by where the request comes from.

Two rules, before the keys are checked (server/guards/auth.py), each a 403 in OpenAI's shape:

* A server listening beyond loopback with no key at all (`--api-key`, `--admin-api-key`)
  refuses its state-changing routes (`ADMIN_PATHS`: clear, pin, unpin, SGLang's flushes):
  anyone who can reach the port could empty every tenant's cache. Generation stays open
  (`serve` warns at start: launch/options.py).
* A browser's request (it carries `Origin` or `Sec-Fetch-*`, which browsers add and page
  scripts cannot remove) must come from the server's own origin: its `Origin` names the
  `Host` it was sent to, `Sec-Fetch-Site` is not cross-site, and on a server listening on
  loopback the `Host` is a loopback name. The first two stop a page elsewhere from posting
  to the server (CSRF: `<form method=post action=http://127.0.0.1:8000/flush_cache>`); the
  third stops DNS rebinding (a page at evil.example:8000 whose name then resolves to
  127.0.0.1 is same-origin to the browser, but its `Host` is evil.example). Clients that
  are not browsers (curl, SDKs, proxies) send neither header and are not affected.

`/health` and `/ready` (PUBLIC_PATHS) answer everyone: they change nothing.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from asynchicache.server.errors import APIError
from asynchicache.server.guards.auth import ADMIN_PATHS, PUBLIC_PATHS

CROSS_SITE = (b"cross-site", b"same-site")  # Sec-Fetch-Site values of another origin


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: not provably local
        return False


def _host_name(host_header: str) -> str:
    """'127.0.0.1:8000' -> '127.0.0.1', '[::1]:8000' -> '::1'."""
    return urlsplit("//" + host_header).hostname or ""


class ExposureGuard:
    """The rules of the module docstring, as plain ASGI (streams pass untouched)."""

    def __init__(self, app: ASGIApp, listen_host: str, keyed: bool) -> None:
        self.app = app
        self.listen_host = listen_host
        self.loopback = is_loopback(listen_host)
        self.keyed = keyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            refusal = self._refusal(scope)
            if refusal is not None:
                await APIError(403, refusal).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> str | None:
        if scope["path"] in ADMIN_PATHS and not self.loopback and not self.keyed:
            return (
                f"this server listens on {self.listen_host}, beyond this machine, without a "
                "key: it does not change its cache for anyone who reaches it. Start it with "
                "--admin-api-key (or --api-key), or --host 127.0.0.1"
            )
        headers = dict(scope.get("headers", ()))
        origin = headers.get(b"origin")
        fetch_site = headers.get(b"sec-fetch-site")
        if origin is None and fetch_site is None and b"sec-fetch-mode" not in headers:
            return None  # not a browser
        host = headers.get(b"host", b"").decode("latin-1")
        if fetch_site in CROSS_SITE or (origin is not None and not _same(origin, host)):
            return "a browser request from another site is refused (its Origin is not this server)"
        if self.loopback and not is_loopback(_host_name(host)):
            return (
                f"a browser request for host {host[:100]!r} is refused: this server listens on "
                "this machine only, and answers browsers only at a loopback name (localhost, "
                "127.0.0.1, [::1])"
            )
        return None


def _same(origin: bytes, host: str) -> bool:
    """Whether `Origin` (scheme://host[:port]) names the `Host` the request was sent to."""
    parts = urlsplit(origin.decode("latin-1"))
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()
