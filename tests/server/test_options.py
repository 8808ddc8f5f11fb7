"""`asynchicache serve` flags: defaults, field mapping, the seed's aliases, bad values."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asynchicache.hierarchy.pools import KVLayout
from asynchicache.launch.frontend import Frontend
from asynchicache.launch.launch import sized_cache
from asynchicache.launch.options import build_parser, parse_args, to_config
from asynchicache.settings.config import (
    PrefetchPolicy,
    ServiceTuning,
    WritePolicy,
    default_disk_cache_dir,
)


def _config(*argv: str):  # -> LaunchConfig
    return to_config(build_parser().parse_args(["--device", "cpu", *argv]))


def test_defaults() -> None:
    cfg = _config()
    assert (cfg.server.host, cfg.server.port, cfg.server.api_key) == ("127.0.0.1", 8000, None)
    assert cfg.engine.model is None and cfg.engine.device == "cpu"
    assert cfg.cache.disk_cache_dir == default_disk_cache_dir()
    assert cfg.cache.host_enabled and cfg.cache.disk_enabled
    assert cfg.host_cache_tokens is None


def test_flags_map_to_fields(tmp_path: Path) -> None:
    cfg = _config(
        "--port",
        "9001",
        "--api-key",
        "k",
        "--dtype",
        "bfloat16",
        "--page-size",
        "32",
        "--device-cache-tokens",
        "4096",
        "--host-cache-gb",
        "0.5",
        "--disk-cache-dir",
        str(tmp_path),
        "--disk-cache-gb",
        "3",
        "--write-policy",
        "write_back",
        "--prefetch-policy",
        "timeout",
        "--disk-admit-hits",
        "2",
        "--disk-admit-tokens",
        "512",
        "--remote-url",
        "redis://127.0.0.1:6379/0",
        "--max-running-requests",
        "4",
        "--chunked-prefill-size",
        "256",
        "--threads",
        "3",
        "--log-level",
        "debug",
    )
    assert cfg.server.port == 9001 and cfg.server.api_key == "k"
    assert cfg.server.log_level == "debug"
    assert cfg.engine.dtype == "bfloat16" and cfg.engine.max_running_requests == 4
    assert cfg.engine.chunked_prefill_size == 256 and cfg.engine.threads == 3
    assert _config().engine.threads is None  # the engine picks engine.threads.default_threads()
    c = cfg.cache
    assert (c.page_size, c.device_cache_tokens, c.host_cache_gb) == (32, 4096, 0.5)
    assert (c.disk_cache_dir, c.disk_cache_gb) == (tmp_path, 3)
    assert c.write_policy is WritePolicy.WRITE_BACK
    assert c.prefetch_policy is PrefetchPolicy.TIMEOUT
    assert (c.disk_admit_hits, c.disk_admit_tokens) == (2, 512)
    assert c.remote_url == "redis://127.0.0.1:6379/0"
    assert _config("--remote-url", "redis://h:1/0", "--remote-ttl", "60").cache.remote_ttl_s == 60


def test_tiers_can_be_switched_off() -> None:
    cfg = _config("--no-disk-cache", "--no-host-cache")
    assert cfg.cache.disk_cache_dir is None and not cfg.cache.disk_enabled
    assert not cfg.cache.host_enabled
    assert not _config("--no-prefix-cache").cache.enable_prefix_cache


def test_the_seeds_flags_keep_the_seeds_meanings() -> None:
    cfg = _config("--use_hiradix_cache", "--hiradix_cache_token_num", "65536")
    assert cfg.cache.host_enabled and cfg.cache.disk_enabled  # the whole hierarchy
    assert cfg.host_cache_tokens == 65536
    with pytest.raises(ValueError, match="--no-disk-cache"):
        _config("--no-disk-cache", "--use_hiradix_cache")  # a contradiction, not an override
    with pytest.raises(ValueError, match="cannot live on the GPU"):
        _config("--hiradix_cache_gpu")  # the PR carved it out of L1: no meaning here


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCHICACHE_API_KEY", "from-env")
    assert _config().server.api_key == "from-env"


@pytest.mark.parametrize(
    "command_line",
    [
        "--port 0",
        "--page-size 0",
        "--device-cache-tokens 8 --page-size 16",
        "--max-running-requests 0",
        "--threads 0",
        "--hiradix_cache_token_num -5",
        "--dtype int3",
        "--write-policy sometimes",
        "--remote-url http://x",
        "--remote-url redis://127.0.0.1:6379/0 --no-disk-cache",
        "--io-threads 0",
        "--workers 0",
        "--client-ttl -1",
        "--min-load-tokens -1",
        "--shutdown-timeout 0",
        '--admin-api-key ""',
    ],
)
def test_bad_values_exit_with_a_message_naming_the_flag(command_line: str) -> None:
    """The message names the first flag of the command line (the one at fault)."""
    argv = shlex.split(command_line)
    proc = subprocess.run(
        [sys.executable, "-m", "asynchicache", "serve", "--device", "cpu", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert argv[0] in proc.stderr


def test_help_explains_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asynchicache", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in (
        "--model",
        "--disk-cache-dir",
        "--use_hiradix_cache",
        "--hiradix_cache_gpu",
        "--hiradix_cache_token_num",
        "--enable-hierarchical-cache",
        "--hicache-storage-backend-extra-config",
        "--enable_cpu_cache",
        "--disk_cache_dir",
        "--remote-url",
        "--api-key",
        "--admin-api-key",
        "--config",
        "--disk-sync",
        "--io-threads",
        "--workers",
        "--client-ttl",
        "--min-load-tokens",
    ):
        assert flag in out
    for title in ("compatibility: SGLang HiCache", "compatibility: LightLLM multi-level cache",
                  "compatibility: the seed's LightLLM hiradix flags"):  # fmt: skip
        assert title in out
    assert out.count("GiB (2**30 bytes)") >= 2  # one unit for every size flag


def test_service_tunables_and_min_load_tokens_reach_the_configs() -> None:
    cfg = _config(
        "--disk-sync",
        "none",
        "--io-threads",
        "3",
        "--workers",
        "2",
        "--client-ttl",
        "9.5",
        "--min-load-tokens",
        "64",
    )
    assert cfg.service == ServiceTuning("none", 3, 2, 9.5)
    assert cfg.engine.min_load_tokens == 64
    assert _config().service == ServiceTuning()


def test_sizes_count_gib() -> None:
    cache = _config("--host-cache-gb", "1.5", "--disk-cache-gb", "2").cache
    assert cache.host_cache_bytes == 3 * 2**29
    assert cache.disk_cache_bytes == 2 * 2**30


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 1000, 65536, 123_457])
def test_token_count_sizes_the_host_tier_exactly(tokens: int, frontend: Frontend) -> None:
    """--hiradix_cache_token_num N gives a pool of exactly ceil(N / page) pages."""
    cfg = _config("--hiradix_cache_token_num", str(tokens))
    cache = sized_cache(cfg, frontend)
    m = frontend.config
    layout = KVLayout(m.num_layers, m.num_kv_heads, m.head_dim, cache.page_size, torch.float32)
    assert layout.page_bytes == cache.page_size * frontend.kv_bytes_per_token("float32")
    assert layout.pages_in(cache.host_cache_bytes) == -(-tokens // cache.page_size)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "serve.yaml",
        "port: 9100\n"
        "disk-cache-gb: 7\n"
        "no_host_cache: true\n"
        "write-policy: write_back\n"
        f"disk-cache-dir: {tmp_path / 'kv'}\n"
        "hiradix_cache_token_num: 4096\n",
    )
    args = parse_args(["--device", "cpu", "--config", str(path), "--port", "9200"])
    cfg = to_config(args)
    assert cfg.server.port == 9200  # the flag wins
    assert cfg.cache.disk_cache_gb == 7 and not cfg.cache.host_enabled
    assert cfg.cache.write_policy is WritePolicy.WRITE_BACK
    assert cfg.cache.disk_cache_dir == tmp_path / "kv"
    assert cfg.host_cache_tokens == 4096


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prot: 1\n", "unknown flag 'prot'"),
        ("port: [1, 2]\n", "port must be a single value"),
        ("port: eighty\n", "invalid literal"),
        ("write-policy: sometimes\n", "write-policy must be one of"),
        ("no-disk-cache: 1\n", "is a switch"),
        ("- port\n", "expected a mapping"),
    ],
)
def test_bad_config_files_exit_with_a_message(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path / "bad.yaml", text)
    proc = subprocess.run(
        [sys.executable, "-m", "asynchicache", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "--config" in proc.stderr
