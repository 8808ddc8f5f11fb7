"""Launch lines from SGLang's and LightLLM's docs start our server with their tiers and
sizes (launch/compat_flags.py): `python -m asynchicache serve` as users run it, its
/cache/stats read back. The model is swapped for the embedded SmolLM2 GGUF, the port for
a free one, and sizes meant for a GPU server scaled to this machine (the config-level
tests in test_compat_flags.py take the lines whole)."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess

from asynchicache.model.loader import default_model_path
from asynchicache.settings.config import GIB

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SMOLLM_PAGE_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # layers, K and V, kv heads, head dim, fp32


def _serve(tmp_path: Path, line: str, env: dict[str, str]) -> ServeProcess:
    argv = shlex.split(line.replace("MODEL", str(default_model_path())))
    return ServeProcess(tmp_path / "serve.log", *argv, env={"PYTHONPATH": str(REPO), **env})


def _stats(server: ServeProcess) -> dict:
    body = {"prompt": "The history of the lighthouse " * 40, "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return httpx.get(server.url + "/cache/stats", timeout=30).json()["cache"]


def test_sglangs_file_backend_line(tmp_path: Path) -> None:
    # SGLang docs, hicache_file_direct_io.md "Launch Example"; L1 sized in tokens, since
    # SGLang sizes it from GPU memory.
    line = """--model-path MODEL --enable-hierarchical-cache --hicache-storage-backend file
      --hicache-ratio 1.2 --page-size 64 --hicache-storage-prefetch-policy wait_complete
      --hicache-storage-backend-extra-config '{"hicache_storage_pass_prefix_keys": true,
      "direct_io": true, "direct_io_alignment": 4096}' --max-total-tokens 2048"""
    folder = tmp_path / "hicache"
    with _serve(tmp_path, line, {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(folder)}) as srv:
        cache = _stats(srv)
        assert cache["device"]["total"] == 2048 // 64
        assert cache["host"]["total"] == -(-int(2048 * 1.2) // 64)  # 1.2 x L1, whole pages
        deadline = time.monotonic() + 60  # stores start once the engine is idle
        while not list(folder.rglob("*.kv")) and time.monotonic() < deadline:
            time.sleep(0.2)
    assert list(folder.rglob("*.kv")), "nothing was stored in SGLang's file-backend folder"


def test_lightllms_three_level_line(tmp_path: Path) -> None:
    # LightLLM docs, multi_level_cache_deployment.rst, L1 + L2 + L3, less --tp 8 and
    # --mem_fraction (refused: test_compat_flags.py), sizes scaled from 400 GB / 1 TB.
    line = """--model_dir MODEL --graph_max_batch_size 500 --enable_fa3 --enable_cpu_cache
      --cpu_cache_storage_size 0.1 --cpu_cache_token_page_size 256 --enable_disk_cache
      --disk_cache_storage_size 1 --disk_cache_dir DIR --max_total_token_num 4096"""
    folder = tmp_path / "disk_cache_dir"
    with _serve(tmp_path, line.replace("DIR", str(folder)), {}) as srv:
        cache = _stats(srv)
        assert cache["device"]["total"] == 4096 // 256
        page_bytes = 256 * SMOLLM_PAGE_BYTES_PER_TOKEN
        assert cache["page_bytes"] == page_bytes
        assert cache["host"]["total"] == int(0.1 * GIB) // page_bytes  # GiB, as LightLLM counts
        assert srv.get_json("/ready")["checks"]["cache_service"] == "ok"  # L3 is on
    assert folder.is_dir()
