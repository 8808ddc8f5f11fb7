"""`--cache-encrypt` through the real cache service: pages stored by a client land encrypted
in the folder, load back, pass `cache verify`, and a service restarted without encryption
(same key file) misses them cleanly (issue 39, encryption at rest)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from pools import NAMESPACE, Pool, new_hashes, refs
from storage_clients import Clients

from asynchicache.storage.base import TicketKind
from asynchicache.storage.disk.disk_admin import verify_folder
from asynchicache.storage.disk.names import namespace_dir_name, page_path
from asynchicache.storage.header import decode_header, peek_header_len


def test_the_service_encrypts_what_it_stores(
    tmp_path: Path, sock_dir: Path, make_pool: Callable[..., Pool], services, clients: Clients
) -> None:
    keys = tmp_path / "keys"
    keys.write_bytes(b"a-secret-of-the-service-" + b"s" * 32 + b"\n")
    keys.chmod(0o600)
    pool = make_pool(16, fill=4)
    addr = f"ipc://{sock_dir}/svc.sock"
    flags = ("--cache-key-file", str(keys))
    first = services(tmp_path / "kv", addr, *flags, "--cache-encrypt")
    client = clients(addr, pool, ready_s=20)
    hashes = new_hashes(4)
    [stored] = client.wait([client.submit_store(refs(hashes, range(4)))], 30)
    assert (stored.pages_ok, stored.error) == (4, None)
    [loaded] = client.wait([client.submit_load(hashes, [8, 9, 10, 11])], 30)
    assert loaded.kind is TicketKind.LOAD and loaded.pages_ok == 4
    assert np.array_equal(pool.array[8:12], pool.array[0:4])

    folder = tmp_path / "kv" / namespace_dir_name(NAMESPACE)
    for i, h in enumerate(hashes):
        raw = page_path(folder, h).read_bytes()
        assert decode_header(raw).encrypted
        assert pool.array[i, :64].tobytes() not in raw[peek_header_len(raw) :]
    report = verify_folder(tmp_path / "kv", remove=False)
    assert report.bad == 0 and report.pages == 4

    assert first.stop() == 0
    services(tmp_path / "kv", addr, *flags)  # the same secrets, no --cache-encrypt
    assert client.wait_ready(20)
    [missed] = client.wait([client.submit_load(hashes[:1], [12])], 30)
    assert missed.pages_ok == 0
