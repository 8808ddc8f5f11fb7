"""A restart of vLLM with our connector, and SmolLM2 (exported by `asynchicache model
export-hf`) under it.

Restart: the session's vLLM `b` (tiny_pair.py) serves a ~1,500-token chat prompt;
then it stops, its cache service with it, and a new vLLM process with the same
flags and folder, whose connector starts a new service that rebuilds its index
from the folder, must serve the prompt mostly from disk, with the same text.
The new `b` stays the session's `b` (test_shared_service.py starts a second
instance beside it: one vLLM start fewer). Answers matter on SmolLM2, started
beside the new `b` (at most two vLLM servers at once): it must still say Paris,
and say it again when the prompt's pages come back from L2 into its own KV layout.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tiny_pair import TinyPair
from vllm_helpers import CONNECTOR, connector_config, hit_after, hits, server, start_all

from asynchicache.bench.processes.vllm_process import VllmFlags, VllmServer
from asynchicache.bench.workloads.text import text
from asynchicache.integrations.vllm.l2.service_process import service_pid

# A vLLM start takes 30-120 s on 2 busy cores; the suite's 300 s per test is too tight
# for a test that starts servers.
pytestmark = pytest.mark.timeout(900)

PAGE = 16  # the connector's page size (tokens)


def _flags(model: Path, disk: Path) -> VllmFlags:
    extra = connector_config(disk, f"ipc://{disk.parent}/run/c.sock")
    return VllmFlags(model, kv_cache_bytes=256 << 20, connector=CONNECTOR, extra_config=extra)


def _usage_tokens(reply: dict) -> int:
    return int(reply["usage"]["prompt_tokens"])


def _content(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


def _says_paris_from_l2_too(smol: VllmServer) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    paris = smol.chat(question)
    assert "Paris" in _content(paris)
    host = hits(smol, "host")
    smol.reset_prefix_cache()  # only our L2 holds the prompt's pages now
    assert _content(smol.chat(question)) == _content(paris)
    full_pages = (_usage_tokens(paris) - 1) // PAGE * PAGE  # one token is always computed
    assert hit_after(smol, "host", host, full_pages) == full_pages


@pytest.mark.slow
def test_paris_then_restart_serves_a_long_prompt_from_disk(
    tiny_pair: TinyPair, smollm_hf: Path, tmp_path: Path
) -> None:
    document = text(random.Random(7), 1400)
    messages = [{"role": "user", "content": f"{document}\n\nSummarise the text in one line."}]
    first = tiny_pair.servers()[1]
    reply = first.chat(messages, max_tokens=24)
    want = _content(reply)
    prompt_tokens = _usage_tokens(reply)
    assert 1400 <= prompt_tokens <= 1700, prompt_tokens
    old_service = service_pid(tiny_pair.socket("b"))
    assert old_service is not None
    tiny_pair.stop()  # `a` and `b`, and their services
    # A new vLLM process; its connector finds no service (the first one's stopped
    # with it) and starts a new one over the same folder, which rebuilds its index.
    # The pair keeps it running after this test.
    second = tiny_pair.new("b")
    smol = server(_flags(smollm_hf, tmp_path / "kv"), tmp_path / "smollm.log")
    try:
        start_all([second, smol])
        _says_paris_from_l2_too(smol)
        disk = hits(second, "disk")
        reply = second.chat(messages, max_tokens=24)
        assert _content(reply) == want
        assert service_pid(tiny_pair.socket("b")) not in (None, old_service)
        loaded = hit_after(second, "disk", disk, 1)
        assert loaded >= 0.9 * prompt_tokens, (loaded, prompt_tokens)
    finally:
        smol.stop()
