"""The redis section of `bench micro` runs end to end on a small size."""

from __future__ import annotations

import argparse

from asynchicache.bench.micro import micro_redis


def test_measure_small(redis_binary: str) -> None:
    parser = argparse.ArgumentParser()
    micro_redis.add_arguments(parser)
    args = parser.parse_args(["--redis-total-mb", "8", "--redis-repeats", "1", "--redis-no-sweep"])
    out = micro_redis.measure(args)
    assert out["pages"] == 8 * (1 << 20) // 737_280
    for key in ("redis_put_GBps", "redis_get_GBps", "redis_py_get_GBps", "redis_mac_put_GBps",
                "redis_mac_get_GBps", "mac_put_ratio", "mac_get_ratio", "redis_enc_put_GBps",
                "redis_enc_get_GBps", "enc_put_ratio", "enc_get_ratio", "cpu_enc_get_s_per_GB",
                "enc_put_cpu_ratio", "enc_get_cpu_ratio", "mac_put_cpu_ratio"):  # fmt: skip
        assert out[key] > 0, out
    assert out["sweep_get_GBps"] == {}
