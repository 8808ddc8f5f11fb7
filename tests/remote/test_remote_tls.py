"""rediss://: the data connections and redis-py's both speak TLS to a real redis-server."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pools import Pool, new_hashes, refs
from ports import free_port
from redis_server import RedisServer
from remote_helpers import Backends


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, signed by itself (it is its own CA)."""
    assert shutil.which("openssl"), "openssl is needed to make a test certificate"
    cert, key = folder / "cert.pem", folder / "key.pem"
    argv = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    argv += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
    argv += ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(argv, check=True, capture_output=True)
    return cert, key


def test_tls_round_trip_with_a_verified_certificate(
    redis_servers: Callable[..., RedisServer],
    remote_backends: Backends,
    make_pool: Callable[..., Pool],
    tmp_path: Path,
) -> None:
    cert, key = _self_signed(tmp_path)
    tls_port = free_port()
    tls = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    tls += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    server = redis_servers(*tls)
    pool = make_pool(8, fill=4)
    backend = remote_backends(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}")
    hashes = new_hashes(4)
    assert backend.put(refs(hashes, range(4)), pool.array) == 4
    assert backend.exists(hashes) == 4
    assert backend.get(hashes, [4, 5, 6, 7], pool.array) == 4
    assert np.array_equal(pool.array[4:8], pool.array[0:4])
    assert server.cli("dbsize") == "4"
    # Without the CA the certificate is refused, and the tier stays down.
    untrusted = remote_backends(f"rediss://127.0.0.1:{tls_port}/0", wait=False)
    assert not untrusted.wait_available(0.5)
    assert untrusted.exists(hashes) == 0
