"""ZeroMQ CURVE certificates for a test: a server's, a listed client's and a stranger's."""

from __future__ import annotations

import os
from pathlib import Path

from asynchicache.common.curve import CurveKeys


def curve_certs(tmp_path: Path) -> tuple[CurveKeys, Path, Path]:
    """(the server's keys, a listed client's certificate, an unlisted client's)."""
    import zmq.auth

    server_dir, clients_dir, others_dir = (tmp_path / n for n in ("server", "clients", "others"))
    for d in (server_dir, clients_dir, others_dir):
        d.mkdir(mode=0o700)
    _, server_secret = zmq.auth.create_certificates(str(server_dir), "server")
    _, client_secret = zmq.auth.create_certificates(str(clients_dir), "router")
    _, other_secret = zmq.auth.create_certificates(str(others_dir), "stranger")
    for secret in (client_secret, other_secret):  # the listed folder keeps public keys only
        os.replace(secret, tmp_path / Path(secret).name)
    keys = CurveKeys(Path(server_secret), clients_dir)
    return keys, tmp_path / Path(client_secret).name, tmp_path / Path(other_secret).name
