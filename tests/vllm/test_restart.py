"""SmolLM2 (exported by `asynchicache model export-hf`) under vLLM with our connector.

Answers matter here: the model must still say Paris, and after a restart of
vLLM *and* of its cache service on the same disk folder a ~1,500-token prompt
must be served mostly from disk, with the same text.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from vllm_helpers import CONNECTOR, hit_after, hits, server

from asynchicache.bench.text import text
from asynchicache.bench.vllm_process import VllmFlags, VllmServer

# A vLLM start takes 30-120 s on 2 busy cores; the suite's 300 s per test is too tight
# for a test whose fixture starts servers.
pytestmark = pytest.mark.timeout(900)


def _flags(model: Path, disk: Path) -> VllmFlags:
    extra = {
        "disk_cache_dir": str(disk),
        "cache_service": f"ipc://{disk.parent}/run/c.sock",
        "host_cache_gb": 0.5,
        "lookup_timeout": 5.0,
        "prefetch_timeout": 30.0,
    }
    return VllmFlags(model, kv_cache_bytes=256 << 20, connector=CONNECTOR, extra_config=extra)


def _usage_tokens(reply: dict) -> int:
    return int(reply["usage"]["prompt_tokens"])


@pytest.mark.slow
def test_paris_then_restart_serves_a_long_prompt_from_disk(smollm_hf: Path, tmp_path: Path) -> None:
    flags = _flags(smollm_hf, tmp_path / "kv")
    document = text(random.Random(7), 1400)
    messages = [{"role": "user", "content": f"{document}\n\nSummarise the text in one line."}]
    first: VllmServer = server(flags, tmp_path / "first.log")
    with first:
        paris = first.chat([{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in paris["choices"][0]["message"]["content"]
        reply = first.chat(messages, max_tokens=24)
        want = reply["choices"][0]["message"]["content"]
        prompt_tokens = _usage_tokens(reply)
        assert 1400 <= prompt_tokens <= 1700, prompt_tokens
    # A new vLLM process; its connector finds no service (the first one's stopped
    # with it) and starts a new one over the same folder, which rebuilds its index.
    second: VllmServer = server(flags, tmp_path / "second.log")
    with second:
        disk = hits(second, "disk")
        reply = second.chat(messages, max_tokens=24)
        assert reply["choices"][0]["message"]["content"] == want
        loaded = hit_after(second, "disk", disk, 1)
        assert loaded >= 0.9 * prompt_tokens, (loaded, prompt_tokens)
