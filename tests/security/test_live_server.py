"""Security of a live `asynchicache serve --api-key ... --admin-api-key ...` (conftest.py):

* every endpoint but /health wants a key (routes enumerated from the app): the admin
  routes the admin key, the others either key;
* its sockets are ipc:// files in a private folder; the HTTP port is its only TCP listener;
* its cache files are private;
* `cache_salt` isolates tenants: tenant B never hits tenant A's prefix;
* a server of another namespace (here: another page size) on the same disk folder
  never serves the first one's pages.
"""

from __future__ import annotations

import os
import re
import stat
import time
import types
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute
from keyed_server import ADMIN_KEY, KEY, auth
from live_server import LiveServer
from traffic import Prompt, complete, make_prompts

from asynchicache.bench.processes.procwatch import descendants
from asynchicache.launch.frontend import Frontend
from asynchicache.server.api import ADMIN_PATHS, PUBLIC_PATHS, create_app

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def prompt(frontend: Frontend) -> Prompt:
    return make_prompts(frontend.tokenizer, "t", 1, lines=20)[0]


def _routes() -> list[tuple[str, str]]:
    app = create_app(types.SimpleNamespace(api_key=None, admin_api_key=None))  # type: ignore[arg-type]
    return sorted(
        (method, route.path)
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    )


def test_every_endpoint_but_health_wants_the_key(server: LiveServer) -> None:
    routes = _routes()
    assert ("POST", "/v1/chat/completions") in routes and ("GET", "/metrics") in routes
    bad_headers = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"X-API-Key": KEY},
    ]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path in routes:
            for headers in bad_headers:
                r = http.request(method, path, headers=headers)
                if path in PUBLIC_PATHS:
                    assert r.status_code == 200, (method, path, r.text)
                    continue
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
            if path in ADMIN_PATHS:
                assert http.request(method, path, headers=server.headers).status_code == 401
            elif path not in PUBLIC_PATHS:
                for key in (KEY, ADMIN_KEY):  # the admin key opens what the API key opens
                    good = http.request(method, path, headers=auth(key))
                    assert good.status_code != 401, (method, path, key)
        # paths that do not exist say nothing without the key either
        assert http.get("/admin").status_code == 401
        assert http.get("/admin", headers=server.headers).status_code == 404


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                out.add(target[8:-1])
    except OSError:
        pass
    return out


def _unix_paths(inodes: set[str]) -> set[str]:
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 8 and cols[6] in inodes:
            paths.add(cols[7])
    return paths


def _tcp_listeners(inodes: set[str]) -> list[tuple[str, int]]:
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                ip, port = cols[1].split(":")
                out.append((ip, int(port, 16)))
    return out


def test_sockets_are_private_and_only_http_listens(server: LiveServer) -> None:
    inodes = set().union(*(_socket_inodes(p) for p in descendants(server.pid)))
    paths = {p for p in _unix_paths(inodes) if not p.startswith("@")}  # @: abstract (monitors)
    assert paths, "no ipc socket found"
    folders = {Path(p).parent for p in paths}
    assert len(folders) == 1, folders  # one private runtime folder per server
    (folder,) = folders
    st = folder.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    log_addr = re.search(r"listening on ipc://(\S+)", server.log_tail(50_000))
    assert log_addr is not None and Path(log_addr.group(1)).parent == folder
    assert _tcp_listeners(inodes) == [("0100007F", server.port)]  # 127.0.0.1:<port>, only


def test_cache_files_are_private(server: LiveServer, prompt: Prompt) -> None:
    with server.client() as http:
        complete(http, prompt, stream=False)
    entries = list(server.disk_dir.rglob("*"))  # type: ignore[union-attr]
    assert any(p.is_file() for p in entries), "nothing was written to disk"
    for p in entries:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def wait_idle(server: LiveServer, timeout_s: float = 120.0) -> None:
    """Until the server's engine has no request, copy or store pending."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = server.stats()
        if not any(s["queues"].values()) and not s["cache"]["pending_storage"]:
            return
        time.sleep(0.1)
    raise AssertionError("the server never went idle")


def _cached(server: LiveServer, prompt: Prompt, salt: str | None) -> int:
    with server.client() as http:
        return sum(complete(http, prompt, stream=False, salt=salt).cached.values())


def _lookup(server: LiveServer, prompt: Prompt, salt: str | None) -> int:
    body: dict[str, object] = {"prompt": list(prompt.ids)}
    if salt is not None:
        body["cache_salt"] = salt
    with server.client() as http:
        r = http.post("/cache/lookup", json=body)
    r.raise_for_status()
    return sum(r.json()["cached_tokens_by_tier"].values())


def test_cache_salt_isolates_tenants(server: LiveServer, frontend: Frontend) -> None:
    secret = make_prompts(frontend.tokenizer, "tenant", 1, lines=20)[0]
    full = (len(secret.ids) - 1) // 16 * 16  # what a repeat can take from the cache
    assert _cached(server, secret, "tenant-a") == 0
    assert _cached(server, secret, "tenant-a") >= full - 16  # A hits its own prefix
    assert _lookup(server, secret, "tenant-a") >= full - 16
    for other in ("tenant-b", "tenant-a ", "TENANT-A", None, ""):
        assert _lookup(server, secret, other) == 0, other
    assert _cached(server, secret, None) == 0  # a client without cache_salt: no hit either
    assert _cached(server, secret, "tenant-b") == 0
    assert _cached(server, secret, "tenant-b") >= full - 16  # B now hits its own copy
    assert _lookup(server, secret, "") == _lookup(server, secret, None) > 0  # "" is no salt


def test_another_namespace_on_the_same_folder_is_never_served(
    server: LiveServer, prompt: Prompt, root: Path
) -> None:
    """A second server on the same folder with --page-size 32, while the first runs."""
    with server.client() as http:
        reference = complete(http, prompt, stream=False).text
    wait_idle(server)
    pages_before = sorted(p.name for p in server.disk_dir.rglob("*.kv"))  # type: ignore[union-attr]
    other = LiveServer(server.disk_dir, root / "other.log", "--page-size", "32", api_key=KEY)
    other.start()
    try:
        assert _lookup(other, prompt, None) == 0
        with other.client() as http:
            answer = complete(http, prompt, stream=False)
        assert sum(answer.cached.values()) == 0
        assert answer.text == reference  # same model, same greedy answer, all recomputed
        storage = other.stats()["storage"]["disk"]
        assert storage["hits"] == 0 and storage["corrupt_detected"] == 0
    finally:
        other.shutdown()
    after = sorted(p.name for p in server.disk_dir.rglob("*.kv"))  # type: ignore[union-attr]
    assert set(pages_before) <= set(after), "the other namespace removed our pages"
