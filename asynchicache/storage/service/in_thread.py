"""The cache service in a thread of this process, behind the same client: the
single-process mode, for tests and small deployments.

The service side builds it, so the client (storage.client) never imports the service.
"""

from __future__ import annotations

import dataclasses
import threading

from asynchicache.storage.client.client_config import ClientConfig
from asynchicache.storage.client.storage_client import StorageClient
from asynchicache.storage.service.server import CacheService
from asynchicache.storage.service.service_config import ServiceConfig


def client_in_thread(service: ServiceConfig, client: ClientConfig) -> StorageClient:
    """A client with its own service running in a thread (stopped by the client's
    `close()`); `client.address` is replaced by the service's."""
    stop = threading.Event()
    svc = CacheService(service, stop)  # binds before the client connects
    thread = threading.Thread(target=svc.run, name="cache-service", daemon=True)
    thread.start()
    made = StorageClient(dataclasses.replace(client, address=service.address))
    made.own_service(stop, thread)
    return made
