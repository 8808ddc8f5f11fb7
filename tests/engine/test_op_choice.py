"""Ours or torch's per op and shape class (model/op_choice.py).

The chooser takes torch's op where its measured time beats ours (by the margin, in most
rounds); the runner then gives the same greedy tokens as the all-native and the torch
runners and as a recompute; the choice is part of the pages' numerics version (all-native
keeps the old version) and stays the same across processes of a host (recorded once).
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from engine_helpers import make_pool

from asynchicache.common.keys import (
    NATIVE8_NUMERICS_VERSION,
    NATIVE_NUMERICS_VERSION,
    NUMERICS_VERSION,
)
from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import SamplingParams
from asynchicache.model import native
from asynchicache.model.loader import LoadedModel, load_model
from asynchicache.model.native import KernelThreads
from asynchicache.model.op_choice import (
    PAIRS,
    PREFILL_PAIRS,
    RECORD_DIR_ENV,
    ChosenRowOps,
    OpChoice,
    Timing,
    choose,
    measure,
    measured_choice,
    record_path,
    settle,
)
from asynchicache.model.runner import (
    ForwardBatch,
    ModelRunner,
    attention_kernel,
    numerics_version,
    prefill_timer,
)
from asynchicache.settings.config import CacheConfig, EngineConfig
from asynchicache.storage.client.storage_client import ClientConfig
from asynchicache.storage.service.in_thread import client_in_thread
from asynchicache.storage.service.server import ServiceConfig
from asynchicache.tools.audit import AuditConfig, deep_verify

PAGE = 8

# `bench kernels --threads 2` on the Sapphire Rapids host (2026-12-07 00:11, load ~1.1), ms
# of ours (the AVX2 build) and torch's per op at 1,557 prefill rows and 8 decode rows.
MEASURED = {
    ("attention", "prefill"): Timing(20.92e-3, 18.46e-3, 0.8),
    ("attention", "decode"): Timing(0.87e-3, 5.59e-3, 0.0),
    ("rms_norm", "prefill"): Timing(0.37e-3, 0.36e-3, 0.6),  # a tie: stays ours
    ("add_rms_norm", "prefill"): Timing(0.35e-3, 0.45e-3, 0.0),
    ("silu_mul", "prefill"): Timing(1.57e-3, 1.19e-3, 1.0),
    ("rotary", "prefill"): Timing(0.30e-3, 0.72e-3, 0.0),
    ("scatter", "prefill"): Timing(0.19e-3, 0.11e-3, 0.4),  # faster at best, not in most rounds
}


def test_the_chooser_takes_torch_where_it_is_faster_by_the_margin_in_most_rounds() -> None:
    choice = choose(MEASURED)
    assert choice.torch_pairs == {("attention", "prefill"), ("silu_mul", "prefill")}
    assert choice.native("attention", 8) and not choice.native("attention", 1557)
    assert choice.native("silu_mul", 63) and not choice.native("silu_mul", 64)
    assert choice.table()["attention"] == {"prefill": "torch", "decode": "native"}
    assert choose(MEASURED, margin=0.5).torch_pairs == set()  # 1.32x is not 1.5x


def test_a_real_measurement_covers_every_op_and_class(tiny_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(tiny_checkpoints["qwen3"])
    timings = measure(_kernel(loaded), loaded.config, budget_s=0.05)
    assert set(timings) == set(PAIRS)
    for t in timings.values():
        assert 0 < t.native_s < 1 and 0 < t.torch_s < 1 and 0 <= t.torch_wins <= 1
    assert choose(timings).torch_pairs <= set(PAIRS)


def test_the_choice_names_the_pages() -> None:
    for base in (NATIVE_NUMERICS_VERSION, NATIVE8_NUMERICS_VERSION):
        assert OpChoice().version(base) == base  # pages of before the choice stay valid
        versions = {base}
        for pair in PAIRS:
            choice = OpChoice(frozenset({pair}))
            version = choice.version(base)
            assert version not in versions | {NUMERICS_VERSION, NATIVE_NUMERICS_VERSION}
            assert OpChoice.from_version(version) == (base, choice)
            versions.add(version)
        every = OpChoice(frozenset(PAIRS))
        assert OpChoice.from_version(every.version(base)) == (base, every)
    assert OpChoice.from_version(NUMERICS_VERSION) == (NUMERICS_VERSION, OpChoice())
    with pytest.raises(ValueError, match="unknown"):
        OpChoice(frozenset({("matmul", "prefill")}))


def test_every_choice_gives_the_tokens_of_a_recompute(tiny_checkpoints: dict[str, Path]) -> None:
    """Prefill in chunks, then greedy decode, under torch's runner, the all-native one and
    two mixed choices: the same tokens (and logits within float32 noise)."""
    loaded = load_model(tiny_checkpoints["llama3-rope-tied"])
    kernel = _kernel(loaded)
    prefill = frozenset(p for p in PAIRS if p[1] == "prefill")
    choices = {
        "native": OpChoice(),
        "torch-prefill": OpChoice(prefill, prefill_rows=8),
        "torch-decode": OpChoice(frozenset(PAIRS) - prefill, prefill_rows=8),
    }
    prompt = torch.randint(0, 1024, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    table = list(range(8))
    ref_logits, ref_tokens = _generate(ModelRunner(loaded.model, make_pool(loaded, 8, PAGE), PAGE),
                                       prompt, table)  # fmt: skip
    for name, choice in choices.items():
        runner = ModelRunner(loaded.model, make_pool(loaded, 8, PAGE), PAGE, kernel, choice)
        assert isinstance(runner.ops, ChosenRowOps), name
        logits, tokens = _generate(runner, prompt, table)
        assert tokens == ref_tokens, name
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4 * ref_logits.abs().max())


def test_one_choice_per_host_and_build(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first process's measurement is recorded (beside the build, or in the folder of
    $ASYNCHICACHE_OP_CHOICE_DIR) and every later one
    reads it back (never measuring again): servers of a host name their pages alike."""
    loaded = load_model(tiny_checkpoints["qwen3"])
    kernel = _kernel(loaded)
    monkeypatch.setenv(RECORD_DIR_ENV, str(tmp_path))
    moved = dataclasses.replace(kernel.kernel, library=Path("/nowhere/kernels-x.so"))
    threads = KernelThreads(moved, kernel.workers)
    measured_choice(threads, loaded.config, budget_s=0.02)
    records = list(tmp_path.glob("kernels-x.choice-*.json"))
    assert len(records) == 1
    recorded = {"torch": [["silu_mul", "prefill"], ["attention", "decode"]]}
    records[0].write_text(json.dumps(recorded))
    again = measured_choice(threads, loaded.config, budget_s=0.02)
    assert again.torch_pairs == {("silu_mul", "prefill"), ("attention", "decode")}
    assert numerics_version(threads, again) == again.version(numerics_version(threads))
    assert numerics_version(threads, again) != numerics_version(threads)


def _kernel(loaded: LoadedModel) -> KernelThreads:
    isa = native.runnable_isas()[0]
    kernel = attention_kernel(loaded.config, torch.float32, torch.device("cpu"), use=True, isa=isa)
    assert kernel is not None
    return kernel


def _generate(
    runner: ModelRunner, prompt: list[int], table: list[int]
) -> tuple[torch.Tensor, list[int]]:
    """Prefill in chunks of 20 (prefill rows) and 5 (decode rows), then 8 greedy tokens."""
    start, logits = 0, None
    for n in (20, 5, 20):
        logits = runner.forward(ForwardBatch([prompt[start : start + n]], [start], [table]))[0]
        start += n
    assert logits is not None
    first, tokens = logits, []
    for _ in range(8):
        tokens.append(int(logits.argmax()))
        logits = runner.forward(ForwardBatch([[tokens[-1]]], [start], [table]))[0]
        start += 1
    return first, tokens


def test_whole_prefills_settle_what_ops_timed_alone_miss(
    tiny_checkpoints: dict[str, Path],
) -> None:
    """Where a whole prefill with torch's ops is faster (our threads and OpenMP's sharing
    the cores), every prefill pair goes to torch; else the per-op choice stands."""
    per_op = OpChoice(frozenset({("silu_mul", "prefill")}))
    all_prefill = OpChoice(per_op.torch_pairs | PREFILL_PAIRS)
    # Seconds of whole 1,557-token prefills, quiet AVX2 run of 2026-12-06 23:49 (621 and
    # 716 tok/s): ours and torch's ops.
    seconds = {per_op: 1557 / 621, all_prefill: 1557 / 716}
    assert settle(per_op, seconds.__getitem__) == all_prefill
    seconds = {per_op: 1557 / 953, all_prefill: 1557 / 980}  # AVX-512: 2.8%, past 2%
    assert settle(per_op, seconds.__getitem__) == all_prefill
    seconds = {per_op: 1.0, all_prefill: 0.99}  # a near tie keeps ours
    assert settle(per_op, seconds.__getitem__) == per_op
    seconds = {per_op: 2.0, all_prefill: 1.0}  # no time for a counted round: ours stay
    assert settle(per_op, seconds.__getitem__, budget_s=0.0) == per_op
    assert settle(all_prefill, seconds.__getitem__) == all_prefill  # nothing to compare
    loaded = load_model(tiny_checkpoints["qwen3"])
    timer = prefill_timer(loaded.model, _kernel(loaded), 70)
    assert settle(per_op, timer) in (per_op, all_prefill)


def test_engines_of_a_host_name_their_pages_by_one_choice(
    tiny_checkpoints: dict[str, Path],
    engines: list[Engine],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two engines on one host: the second reads the first's recorded choice, so both
    name pages alike, and that name holds the choice their runners compute with."""
    monkeypatch.setenv(RECORD_DIR_ENV, str(tmp_path))
    loaded = load_model(tiny_checkpoints["llama3-rope-tied"])
    config = CacheConfig(page_size=PAGE, device_cache_tokens=256, disk_cache_dir=None,
                         host_cache_gb=0.0)  # fmt: skip
    for _ in range(2):
        engines.append(Engine(EngineConfig(), config, loaded=loaded))
    first, second = engines
    assert first.namespace == second.namespace
    assert first.op_choice == second.op_choice == first.runner.choice
    assert first.runner.kernel is not None
    version = numerics_version(first.runner.kernel, first.op_choice)
    assert first.namespace.numerics_version == version
    assert OpChoice.from_version(version)[1] == first.op_choice
    assert len(list(tmp_path.glob("*.choice-*.json"))) == 1


def test_the_audit_recomputes_pages_with_the_choice_that_named_them(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine whose recorded choice runs torch's ops for prefills stores pages under
    that choice's version; `cache verify --deep` reads the choice back from the version
    and finds every page equal to its recompute."""
    monkeypatch.setenv(RECORD_DIR_ENV, str(tmp_path / "choice"))
    loaded = load_model(tiny_checkpoints["llama3-rope-tied"])
    kernel = _kernel(loaded)
    chosen = OpChoice(PREFILL_PAIRS | {("scatter", "decode")})
    record = record_path(kernel, loaded.config)
    record.parent.mkdir()
    record.write_text(json.dumps({"torch": sorted(map(list, chosen.torch_pairs))}))
    root, sock = tmp_path / "kv", Path(tempfile.mkdtemp(prefix="acs-"))
    service = ServiceConfig(root, address=f"ipc://{sock}/svc.sock")
    client = client_in_thread(service, ClientConfig(service.address))
    engine = Engine(EngineConfig(), CacheConfig(disk_cache_dir=root, host_cache_gb=0.05),
                    storage=client, loaded=loaded)  # fmt: skip
    try:
        assert engine.op_choice == chosen
        assert OpChoice.from_version(engine.namespace.numerics_version)[1] == chosen
        rng = random.Random(5)
        prompts = [[rng.randrange(1, 1024) for _ in range(n)] for n in (70, 45)]
        engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engine.cache.drain()
    finally:
        engine.close()
        client.close()
        shutil.rmtree(sock, ignore_errors=True)
    report = deep_verify(AuditConfig(root, model=str(tiny_checkpoints["llama3-rope-tied"]),
                                     progress=False))  # fmt: skip
    assert report.checked == report.pages >= 6
    assert report.mismatched == report.corrupt == report.unverifiable == 0
