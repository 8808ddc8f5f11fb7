"""Our engine on CUDA against its CPU path: logits, greedy answers, and every cache tier.

The model (the embedded SmolLM2, or gpu-check.sh's random one of its shape) runs on
the GPU in float32 and bfloat16 and on the CPU in the same dtype; the GPU must give
the CPU's logits (float32: to a few hundredths; bfloat16 rounds differently on each
device, so there it must pick the CPU's greedy token wherever the CPU's choice is
clear) and, through the engine with L1 on the GPU, the same greedy answer
recomputed, from L1, from L2 (pinned host memory, copies on a side stream) and from
L3 after a restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cuda_marks import ON_CUDA, cuda_test_model
from engine_fixtures import checked_engines

from asynchicache.bench.engine_speed import new_runner
from asynchicache.bench.ttft import real_text_prompt
from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import SamplingParams
from asynchicache.model.loader import LoadedModel, load_model
from asynchicache.model.runner import ForwardBatch
from asynchicache.settings.config import CacheConfig, EngineConfig
from asynchicache.storage.client.storage_client import ClientConfig
from asynchicache.storage.service.in_thread import client_in_thread
from asynchicache.storage.service.server import ServiceConfig

pytestmark = ON_CUDA

DTYPES = ("float32", "bfloat16")
STEPS = 16
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
CLEAR_MARGIN = 0.5  # bfloat16: a CPU top-1 this far above its runner-up must be the GPU's


@pytest.fixture(scope="module", params=DTYPES)
def pair(request: pytest.FixtureRequest) -> tuple[LoadedModel, LoadedModel]:
    """The model on the CPU and on the GPU, in one dtype."""
    model = cuda_test_model()
    return load_model(model, request.param, "cpu"), load_model(model, request.param, "cuda")


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    yield from checked_engines(l1_released=False)


def _decode(
    model: LoadedModel, prompt: list[int], forced: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """`STEPS` decode steps after the prompt: greedy, or feeding `forced` back instead.
    Returns the tokens fed and the last-position logits before each step, `[STEPS, vocab]`
    float32 on the CPU."""
    runner, tables = new_runner(model, len(prompt) + STEPS + 1, 1)
    logits = runner.forward(ForwardBatch([prompt], [0], tables))[0]
    tokens: list[int] = []
    rows = []
    for i in range(STEPS):
        rows.append(logits.float().cpu())
        tokens.append(int(rows[-1].argmax()) if forced is None else forced[i])
        logits = runner.forward(ForwardBatch([[tokens[-1]]], [len(prompt) + i], tables))[0]
    return tokens, torch.stack(rows)


def test_gpu_logits_and_greedy_tokens_are_the_cpu_paths(
    pair: tuple[LoadedModel, LoadedModel],
) -> None:
    cpu, gpu = pair
    prompt = real_text_prompt(cpu, 300)
    tokens, want = _decode(cpu, prompt)  # the CPU's greedy answer
    _, got = _decode(gpu, prompt, forced=tokens)  # the GPU fed the same tokens
    assert got.shape == want.shape and torch.isfinite(got).all()
    if cpu.dtype == "float32":
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-3)
        assert got.argmax(-1).tolist() == tokens  # its own greedy answer is the CPU's
        return
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min() > 0.99, cosine
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_MARGIN
    assert clear.sum() >= STEPS // 2, "too few clear choices to compare"
    assert (got.argmax(-1) == want.argmax(-1))[clear].all()


def test_the_engine_on_cuda_answers_alike_from_every_tier(
    pair: tuple[LoadedModel, LoadedModel], engines: list[Engine], tmp_path: Path
) -> None:
    """L1 on the GPU, L2 pinned, L3 on disk: the same greedy answer recomputed (and, in
    float32, the CPU engine's), from L1, from L2 and from L3 after a restart."""
    cpu, gpu = pair
    prompt = real_text_prompt(gpu, 700)

    def engine(model: LoadedModel, disk: bool = True) -> Engine:
        config = EngineConfig(device=model.device, dtype=model.dtype, prompt_logits_mib=0)
        if not disk:
            cache = CacheConfig(enable_prefix_cache=False, disk_cache_dir=None)
            made = Engine(config, cache, loaded=model)
        else:
            service = ServiceConfig(tmp_path / "kv", address=f"ipc://{tmp_path}/svc.sock")
            client = client_in_thread(service, ClientConfig(service.address))
            cache = CacheConfig(disk_cache_dir=tmp_path / "kv", host_cache_gb=0.25)
            made = Engine(config, cache, storage=client, loaded=model)
            assert client.wait_ready(30)
        engines.append(made)
        return made

    plain = engine(gpu, disk=False)
    expected = plain.generate([prompt], GREEDY)[0].token_ids
    if cpu.dtype == "float32":
        assert engine(cpu, disk=False).generate([prompt], GREEDY)[0].token_ids == expected
    first = engine(gpu)
    assert first.cache.device_pool.tensor.device.type == "cuda"
    assert first.cache.host_pool is not None and first.cache.host_pool.pinned
    cold = first.generate([prompt], GREEDY)[0]
    assert cold.token_ids == expected and cold.cached.total == 0
    l1 = first.generate([prompt], GREEDY)[0]
    assert l1.token_ids == expected and l1.cached.device >= len(prompt) - 32
    first.cache.drain()  # the write-through copies to L2 (a side stream) have landed
    first.cache.evict(first.cache.stats().device.total)
    l2 = first.generate([prompt], GREEDY)[0]
    assert l2.token_ids == expected and l2.cached.host >= len(prompt) - 32
    first.cache.drain()  # every L2 -> disk store has finished
    engines.remove(first)
    first.cache.check_integrity()
    first.close()
    first.cache.storage.close()  # type: ignore[union-attr]
    second = engine(gpu)
    l3 = second.generate([prompt], GREEDY)[0]
    assert l3.token_ids == expected and l3.cached.disk >= len(prompt) - 32
