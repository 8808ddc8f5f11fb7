"""asynchicache as a vLLM v1 KV connector: our L2 host, L3 disk and L4 remote tiers.

    --kv-transfer-config '{"kv_connector": "AsynchicacheConnector",
                           "kv_connector_module_path": "asynchicache.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"disk_cache_dir": "DIR"}}'

The connector class is imported lazily (PEP 562), so the pure parts of this
package (config, layouts, the slot index) import without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AsynchicacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "AsynchicacheConnector":
        from asynchicache.integrations.vllm.connector import AsynchicacheConnector

        return AsynchicacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
