"""The connector's `kv_connector_extra_config`: config.py's units, and the documented keys of
earlier releases still read."""

from __future__ import annotations

import pytest

from asynchicache.integrations.vllm.connector_config import OLD_KEYS, ConnectorConfig
from asynchicache.settings.config import GIB


def test_host_cache_gb_counts_gib_as_the_serve_flag_does() -> None:
    assert ConnectorConfig.from_extra({"host_cache_gb": 1.5}).host_cache_bytes == int(1.5 * GIB)


def test_durations_carry_their_unit_and_the_old_keys_still_work() -> None:
    old = ConnectorConfig.from_extra({"lookup_timeout": 3.0, "remote_ttl": 60})
    new = ConnectorConfig.from_extra({"lookup_timeout_s": 3.0, "remote_ttl_s": 60})
    assert old == new and new.lookup_timeout_s == 3.0 and new.remote_ttl_s == 60
    assert all(new_key.endswith("_s") for new_key in OLD_KEYS.values())


def test_an_unknown_key_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="lookup_timeout_s"):
        ConnectorConfig.from_extra({"lookup_timout_s": 1.0})
