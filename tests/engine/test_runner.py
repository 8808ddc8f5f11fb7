"""The paged runner: chunking, cached prefixes, mixed batches and page placement
must not change the logits (beyond float32 noise) or the greedy continuation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_helpers import make_pool

from asynchicache.model import native
from asynchicache.model import runner as runner_module
from asynchicache.model.loader import LoadedModel, load_model
from asynchicache.model.native import KernelThreads
from asynchicache.model.op_choice import OPS, OpChoice
from asynchicache.model.runner import ForwardBatch, ModelRunner, attention_kernel, length_groups

PAGE = 8
PAGES = 64


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


RunnerFactory = Callable[..., ModelRunner]


# Torch's ops for every prefill-class pair (forwards of 8 rows or more), ours for decodes:
# the engine's choice where every native op loses at prefill shapes (op_choice.py).
MIXED = OpChoice(frozenset((op, "prefill") for op in OPS), prefill_rows=8)


@pytest.fixture(
    scope="module",
    params=[
        "torch",
        *(f"kernel-{isa}" for isa in native.runnable_isas()),
        f"mixed-{native.runnable_isas()[0]}",
    ],
)
def runner_for(request: pytest.FixtureRequest) -> RunnerFactory:
    """Runners attending with torch (gathered pages), with the native kernel (in place), or
    with the kernel for decodes and torch's ops for prefills: every test below holds for
    each."""

    def make(loaded: LoadedModel, pool: torch.Tensor | None = None) -> ModelRunner:
        kernel: KernelThreads | None = None
        kind, _, isa = request.param.partition("-")
        if isa:
            c = loaded.config
            kernel = attention_kernel(c, torch.float32, torch.device("cpu"), use=True, isa=isa)
        pool = make_pool(loaded, PAGES, PAGE) if pool is None else pool
        return ModelRunner(loaded.model, pool, PAGE, kernel, MIXED if kind == "mixed" else None)

    return make


def prefill_chunks(
    runner: ModelRunner, prompt: list[int], table: list[int], sizes: list[int]
) -> torch.Tensor:
    """Feed `prompt` in chunks of the given sizes (cycled); returns the last logits [vocab]."""
    start, i = 0, 0
    logits = None
    while start < len(prompt):
        n = min(sizes[i % len(sizes)], len(prompt) - start)
        logits = runner.forward(ForwardBatch([prompt[start : start + n]], [start], [table]))[0]
        start, i = start + n, i + 1
    assert logits is not None
    return logits


def greedy_after(
    runner: ModelRunner, logits: torch.Tensor, start: int, table: list[int], steps: int
) -> list[int]:
    out = []
    for _ in range(steps):
        token = int(logits.argmax())
        out.append(token)
        logits = runner.forward(ForwardBatch([[token]], [start], [table]))[0]
        start += 1
    return out


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * max(b.abs().max().item(), 1.0))


@pytest.fixture(scope="module")
def models(tiny_checkpoints: dict[str, Path]) -> dict[str, LoadedModel]:
    return {
        name: load_model(tiny_checkpoints[name])
        for name in ("llama3-rope-tied", "mistral-window", "qwen3")
    }


@pytest.mark.parametrize("name", ["llama3-rope-tied", "mistral-window", "qwen3"])
@pytest.mark.parametrize("sizes", [[45], [1], [5], [3, 13], [8, 7, 9]])
def test_chunked_prefill_equals_whole(
    runner_for: RunnerFactory, models: dict[str, LoadedModel], name: str, sizes: list[int]
) -> None:
    loaded = models[name]
    prompt = prompt_of(45, seed=3)
    table = list(range(10, 17))  # 7 pages of 8 hold 45 + 10 tokens
    whole_runner = runner_for(loaded)
    whole = prefill_chunks(whole_runner, prompt, table, [len(prompt)])
    chunked_runner = runner_for(loaded)
    chunked = prefill_chunks(chunked_runner, prompt, table, sizes)
    close(chunked, whole)
    assert greedy_after(chunked_runner, chunked, 45, table, 10) == greedy_after(
        whole_runner, whole, 45, table, 10
    )


def test_cached_prefix_then_rest(runner_for: RunnerFactory, models: dict[str, LoadedModel]) -> None:
    """start > 0: the prefix's KV comes from the pool (computed by another runner call)."""
    loaded = models["llama3-rope-tied"]
    prompt = prompt_of(37, seed=4)
    table = [5, 6, 7, 8, 9, 10]
    whole = prefill_chunks(runner_for(loaded), prompt, table, [37])
    for prefix in (8, 17, 36):
        runner = runner_for(loaded)
        runner.forward(ForwardBatch([prompt[:prefix]], [0], [table]))
        rest = runner.forward(ForwardBatch([prompt[prefix:]], [prefix], [table]))[0]
        close(rest, whole)


def test_pages_scattered_or_contiguous_give_same_logits(
    runner_for: RunnerFactory, models: dict[str, LoadedModel]
) -> None:
    loaded = models["qwen3"]
    prompt = prompt_of(30, seed=5)
    contiguous = prefill_chunks(runner_for(loaded), prompt, [0, 1, 2, 3, 4], [11])
    scattered = prefill_chunks(runner_for(loaded), prompt, [63, 2, 40, 17, 9], [11])
    close(scattered, contiguous)


def test_kv_is_written_into_the_pool_in_place(
    runner_for: RunnerFactory, models: dict[str, LoadedModel]
) -> None:
    loaded = models["llama3-rope-tied"]
    pool = make_pool(loaded, PAGES, PAGE)
    runner = runner_for(loaded, pool)
    table = [40, 3, 21]
    runner.forward(ForwardBatch([prompt_of(20, seed=6)], [0], [table]))
    # [pages, layers, 2, page_size, kv_heads, hd]: pages 40 and 3 full, page 21 holds 4 tokens
    assert pool[[40, 3]].abs().amax(dim=(1, 2, 4, 5)).gt(0).all()
    assert pool[21, :, :, :4].abs().amax() > 0
    assert pool[21, :, :, 4:].abs().amax() == 0
    untouched = [p for p in range(PAGES) if p not in table]
    assert pool[untouched].abs().amax() == 0


def test_mixed_batch_equals_each_alone(
    runner_for: RunnerFactory, models: dict[str, LoadedModel]
) -> None:
    """Prefill from 0, a prefill chunk after a prefix, and two decodes, in one batch."""
    loaded = models["mistral-window"]
    prompts = [prompt_of(n, seed=10 + n) for n in (23, 30, 19, 41)]
    tables = [[0, 1, 2, 3], [10, 4, 11, 5, 12], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
    done = [0, 12, 18, 40]  # tokens each has in the pool before the mixed step
    base = make_pool(loaded, PAGES, PAGE)
    setup = runner_for(loaded, base)
    for prompt, table, n in zip(prompts, tables, done, strict=True):
        if n:
            setup.forward(ForwardBatch([prompt[:n]], [0], [table]))
    new = [p[n:] for p, n in zip(prompts, done, strict=True)]  # 23, 18, 1, 1 tokens
    mixed = runner_for(loaded, base.clone()).forward(ForwardBatch(new, done, tables))
    for i in range(4):
        alone = runner_for(loaded, base.clone()).forward(
            ForwardBatch([new[i]], [done[i]], [tables[i]])
        )
        close(mixed[i], alone[0])


def test_decode_batch_of_different_lengths(
    runner_for: RunnerFactory, models: dict[str, LoadedModel]
) -> None:
    loaded = models["qwen3"]
    lengths = [3, 17, 9, 33, 1]
    tables = [[i * 6 + j for j in range(6)] for i in range(len(lengths))]
    base = make_pool(loaded, PAGES, PAGE)
    setup = runner_for(loaded, base)
    prompts = [prompt_of(n + 1, seed=20 + n) for n in lengths]
    for prompt, table, n in zip(prompts, tables, lengths, strict=True):
        setup.forward(ForwardBatch([prompt[:n]], [0], [table]))
    batch = ForwardBatch([[p[n]] for p, n in zip(prompts, lengths, strict=True)], lengths, tables)
    together = runner_for(loaded, base.clone()).forward(batch)
    for i in range(len(lengths)):
        alone = runner_for(loaded, base.clone()).forward(
            ForwardBatch([[prompts[i][lengths[i]]]], [lengths[i]], [tables[i]])
        )
        close(together[i], alone[0])


def test_logits_are_float32_one_row_per_sequence(
    runner_for: RunnerFactory, models: dict[str, LoadedModel]
) -> None:
    loaded = models["llama3-rope-tied"]
    out = runner_for(loaded).forward(
        ForwardBatch([prompt_of(9, 1), [5], prompt_of(3, 2)], [0, 0, 0], [[0, 1], [2], [3]])
    )
    assert out.shape == (3, loaded.config.vocab_size)
    assert out.dtype == torch.float32


def test_bad_batches_are_rejected(
    runner_for: RunnerFactory, models: dict[str, LoadedModel]
) -> None:
    loaded = models["llama3-rope-tied"]
    runner = runner_for(loaded)
    with pytest.raises(ValueError, match="needs 2 pages"):
        runner.forward(ForwardBatch([prompt_of(9, 1)], [0], [[0]]))
    with pytest.raises(ValueError, match="outside"):
        runner.forward(ForwardBatch([[1, 2]], [0], [[PAGES]]))
    with pytest.raises(ValueError, match="no new tokens"):
        ForwardBatch([[]], [0], [[0]])
    with pytest.raises(ValueError, match="must match"):
        ForwardBatch([[1]], [0, 1], [[0]])
    with pytest.raises(ValueError, match="does not fit the model"):
        ModelRunner(loaded.model, torch.zeros(4, 3, 2, PAGE, 2, 16), PAGE)
    with pytest.raises(ValueError, match="bfloat16"):
        ModelRunner(loaded.model, make_pool(loaded, 4, PAGE).bfloat16(), PAGE)


def test_length_groups_minimize_padding_plus_overhead() -> None:
    pages = [1, 10, 2, 10, 1]
    # One group: 5 x 10 + 3 = 53; {1, 1, 2} {10, 10}: 3 x 2 + 3 + 2 x 10 + 3 = 32 (best).
    assert length_groups(pages, overhead=3) == [[1, 3], [0, 4, 2]]
    assert length_groups(pages, overhead=0) == [[1, 3], [2], [0, 4]]
    assert length_groups(pages, overhead=100) == [[0, 4, 2, 1, 3]]
    assert length_groups([], overhead=3) == []


@pytest.mark.parametrize("overhead", [0, 10**9])
def test_decode_groups_give_each_sequence_its_own_logits(
    runner_for: RunnerFactory,
    models: dict[str, LoadedModel],
    overhead: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decodes of very different lengths (beyond the sliding window too) next to a
    prefill chunk, in one padded group or one group per length: as each alone."""
    loaded = models["mistral-window"]
    lengths = [3, 40, 9, 33, 1, 40]
    tables = [[i * 6 + j for j in range(6)] for i in range(len(lengths))]
    base = make_pool(loaded, PAGES, PAGE)
    setup = runner_for(loaded, base)
    prompts = [prompt_of(n + 1, seed=30 + i) for i, n in enumerate(lengths)]
    for prompt, table, n in zip(prompts, tables, lengths, strict=True):
        setup.forward(ForwardBatch([prompt[:n]], [0], [table]))
    new = [[p[n]] for p, n in zip(prompts, lengths, strict=True)]
    extra = prompt_of(12, seed=99)  # a prefill in the same batch: no decode-only fast path
    monkeypatch.setattr(runner_module, "GROUP_OVERHEAD_PAGES", overhead)
    together = runner_for(loaded, base.clone()).forward(
        ForwardBatch([*new, extra], [*lengths, 0], [*tables, [60, 61]])
    )
    decodes_only = runner_for(loaded, base.clone()).forward(ForwardBatch(new, lengths, tables))
    for i in range(len(lengths)):
        alone = runner_for(loaded, base.clone()).forward(
            ForwardBatch([new[i]], [lengths[i]], [tables[i]])
        )
        close(together[i], alone[0])
        close(decodes_only[i], alone[0])
