"""Other servers' flags with their meanings (launch/compat_flags.py): launch lines copied
from SGLang's and LightLLM's docs give the same tiers, sizes and policies here; what
cannot hold is refused, all at once, with what to do instead."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from asynchicache.launch.compat_resolve import CompatError
from asynchicache.launch.options import build_parser, to_config
from asynchicache.settings.config import GIB, PrefetchPolicy, WritePolicy

# SGLang docs, advanced_features/hicache_file_direct_io.md, "Launch Example" (model swapped).
SGLANG_FILE_LINE = """--model-path MODEL --host 0.0.0.0 --port 30000 --enable-hierarchical-cache
  --hicache-storage-backend file --hicache-ratio 1.2 --page-size 64
  --hicache-storage-prefetch-policy wait_complete --hicache-storage-backend-extra-config
  '{"hicache_storage_pass_prefix_keys": true, "direct_io": true, "direct_io_alignment": 4096}'"""
# LightLLM docs, tutorial/multi_level_cache_deployment.rst, the L1 + L2 + L3 line (model swapped).
LIGHTLLM_LINE = """--model_dir MODEL --tp 8 --graph_max_batch_size 500 --enable_fa3
  --mem_fraction 0.88 --enable_cpu_cache --cpu_cache_storage_size 400
  --cpu_cache_token_page_size 256 --enable_disk_cache --disk_cache_storage_size 1000
  --disk_cache_dir /mnt/ssd/disk_cache_dir"""
# SGLang docs, hicache_best_practices.md, "Deployment with Mooncake" (model swapped).
SGLANG_MOONCAKE_LINE = """--model-path MODEL --tp 8 --page-size 64 --enable-hierarchical-cache
  --hicache-ratio 2 --hicache-mem-layout page_first --hicache-io-backend kernel
  --hicache-storage-backend mooncake --hicache-write-policy write_through
  --hicache-storage-prefetch-policy timeout"""


def _config(line: str, model: str = "m.gguf", env: dict[str, str] | None = None):
    argv = shlex.split(line.replace("MODEL", model))
    return to_config(build_parser().parse_args(["--device", "cpu", *argv]), env or {})


def test_sglangs_file_backend_line_gives_its_tiers(tmp_path: Path) -> None:
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path / "hicache")}
    cfg = _config(SGLANG_FILE_LINE, env=env)
    c = cfg.cache
    assert (cfg.engine.model, cfg.server.host, cfg.server.port) == ("m.gguf", "0.0.0.0", 30000)
    assert c.page_size == 64 and c.host_enabled and c.disk_enabled
    assert cfg.host_cache_tokens == int(c.device_cache_tokens * 1.2)  # L2 = 1.2 x L1
    assert c.disk_cache_dir == tmp_path / "hicache" and c.remote_url is None
    assert c.prefetch_policy is PrefetchPolicy.WAIT_COMPLETE
    assert c.write_policy is WritePolicy.WRITE_THROUGH  # SGLang's default
    # Without the variable, HiCacheFile's own folder.
    assert _config(SGLANG_FILE_LINE).cache.disk_cache_dir == Path("/tmp/hicache")


def test_sglang_defaults_and_units_hold_for_what_is_not_given() -> None:
    cfg = _config("--enable-hierarchical-cache --max-total-tokens 4096")
    c = cfg.cache
    assert c.device_cache_tokens == 4096 and cfg.host_cache_tokens == 8192  # ratio 2.0
    assert not c.disk_enabled, "SGLang has no L3 without --hicache-storage-backend"
    assert c.prefetch_policy is PrefetchPolicy.TIMEOUT
    assert (c.prefetch_timeout_s, c.prefetch_timeout_per_ki_token_s) == (1.0, 0.25)
    sized = _config("--enable-hierarchical-cache --hicache-size 100").cache
    assert sized.host_cache_bytes == pytest.approx(100e9, abs=1)  # GB of 10**9 bytes
    extra = ('{"prefetch_threshold": 512, "prefetch_timeout_base": 3, '
             '"prefetch_timeout_per_ki_token": 0}')  # fmt: skip
    tuned = _config(
        f"--hicache-storage-backend file --hicache-storage-backend-extra-config '{extra}'"
    )
    assert tuned.engine.min_load_tokens == 512
    assert (tuned.cache.prefetch_timeout_s, tuned.cache.prefetch_timeout_per_ki_token_s) == (3, 0)


def test_sglangs_valkey_backend_is_l4_at_the_valkey_variables() -> None:
    # SGLang docs, hicache_valkey_storage.md: the variables and the one flag.
    env = {"VALKEY_HOST": "cache.local", "VALKEY_PORT": "6380", "VALKEY_PASSWORD": "p w"}
    cfg = _config("--model-path MODEL --hicache-storage-backend valkey", env=env)
    assert cfg.cache.remote_url == "redis://:p%20w@cache.local:6380/0"
    assert cfg.cache.disk_enabled, "L4 sits behind an L3 folder here"


def test_lightllms_three_level_line_gives_its_tiers_once_the_gpu_flags_go() -> None:
    with pytest.raises(CompatError) as refused:
        _config(LIGHTLLM_LINE)
    message = str(refused.value)  # both reported at once, each with what to do instead
    assert "--tp 8" in message and "one server per device" in message
    assert "--mem_fraction" in message and "--max_total_token_num" in message
    line = LIGHTLLM_LINE.replace("--tp 8 ", "").replace("--mem_fraction 0.88", "")
    cfg = _config(line)
    c = cfg.cache
    assert c.host_enabled and c.host_cache_bytes == 400 * GIB  # LightLLM counts GiB too
    assert c.page_size == 256
    assert c.disk_enabled and c.disk_cache_bytes == 1000 * GIB
    assert c.disk_cache_dir == Path("/mnt/ssd/disk_cache_dir")
    assert cfg.engine.model == "m.gguf"


def test_lightllms_two_level_line_has_no_disk_and_its_defaults() -> None:
    cfg = _config("--model_dir MODEL --enable_cpu_cache")
    assert cfg.cache.host_enabled and cfg.cache.host_cache_gb == 2.0
    assert cfg.cache.page_size == 256 and not cfg.cache.disk_enabled
    env = {"LIGHTLLM_DISK_CACHE_PROMPT_LIMIT_LENGTH": "128"}
    three = _config("--enable_cpu_cache --enable_disk_cache", env=env)
    assert three.cache.disk_cache_gb == 10.0 and three.cache.disk_admit_tokens == 128


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (SGLANG_MOONCAKE_LINE, "no mooncake backend"),
        (SGLANG_MOONCAKE_LINE, "--hicache-io-backend kernel: no custom copy kernels"),
        ("--enable-hierarchical-cache --hicache-mem-layout layer_first", "page-first"),
        ("--hicache-storage-backend hf3fs", "L4 is Redis or Valkey"),
        ("--hicache-storage-backend-extra-config '{\"direct_io\": false}' "
         "--hicache-storage-backend file", "cannot turn it off"),
        ("--hicache-storage-backend-extra-config '{\"cost\": 1}'", "no counterpart here for cost"),
        ("--hicache-storage-backend-extra-config 'nope'", "not a JSON object"),
        ("--hicache-storage-backend file --hicache-storage-backend-extra-config "
         "'{\"prefetch_timeout_base\": NaN}'", "prefetch_timeout_base must be a finite number"),
        ("--hicache-storage-backend file --hicache-storage-backend-extra-config "
         "'{\"host\": \"h\"}'", "go with --hicache-storage-backend valkey"),
        ("--mem-fraction-static 0.8", "--device-cache-tokens"),
        ("--enable_disk_cache", "needs --enable_cpu_cache"),
        ("--enable_cpu_cache --enable-hierarchical-cache", "in one launch line"),
        ("--hicache-size 10 --hiradix_cache_token_num 4096", "both size L2"),
        ("--hicache-ratio 2 --hiradix_cache_token_num 4096", "disagree"),
        ("--hiradix_cache_token_num 4096 --host-cache-gb 1", "both size L2"),
        ("--enable_cpu_cache --cpu_cache_storage_size 3 --host-cache-gb 1", "give one"),
        ("--use_hiradix_cache --no-prefix-cache", "turns caching off"),
    ],
)  # fmt: skip
def test_what_cannot_hold_is_refused_with_what_to_do(line: str, says: str) -> None:
    with pytest.raises(CompatError, match=says.replace("(", r"\(")):
        _config(line)


@pytest.mark.parametrize("flag", ["--hicache-ratio", "--cpu_cache_storage_size"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_their_float_flags_refuse_nan_and_inf_with_the_flags_name(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([flag, value])
    assert flag in capsys.readouterr().err


def test_performance_knobs_without_a_counterpart_are_accepted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("INFO"):
        cfg = _config("--enable-metrics --enable-cache-report --tp 1 --enable_fa3")
    assert cfg.cache.host_enabled and cfg.cache.disk_enabled  # our defaults: no peer's tiers
    assert "--enable-metrics ignored" in caplog.text and "--enable_fa3 ignored" in caplog.text
