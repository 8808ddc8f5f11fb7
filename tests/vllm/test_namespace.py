"""The namespace names everything in vLLM's config that changes the K/V numbers.

Two configs that differ only in one such setting never share a page: their
namespaces (the root of every page's chained name) differ. Each factor is read
from a real `VllmConfig` where vLLM builds one on CPU (namespace builder unit
tests otherwise).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from sched_harness import make_vllm_config, tiny_model_folder

from asynchicache.integrations.vllm.layouts.numerics import numerics_factors, selected_backend
from asynchicache.integrations.vllm.namespace import (
    ModelIdentity,
    pinned_revision,
    vllm_namespace,
)

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("ns-model"))


def identity(**changes: Any) -> ModelIdentity:
    base = ModelIdentity(
        model="org/model",
        revision=COMMIT_A,
        vllm_version="0.32.0",
        device="cpu",
        attention_backend="CPU_ATTN:vec",
        kv_dtype="float32",
        block_size=128,
        numerics=(("dtype", "float32"), ("quantization", "none")),
    )
    return dataclasses.replace(base, **changes)


def digest(ident: ModelIdentity) -> bytes:
    return vllm_namespace(ident, 16).digest()


@pytest.mark.parametrize(
    "change",
    [
        {"attention_backend": "FLASH_ATTN"},
        {"attention_backend": "CPU_ATTN:vec16"},  # another CPU kernel
        {"tp_size": 2},
        {"revision": COMMIT_B},  # other weights of the same hub model
        {"kv_dtype": "bfloat16"},
        {"numerics": (("dtype", "float32"), ("quantization", "fp8"))},
        {"numerics": (("dtype", "bfloat16"), ("quantization", "none"))},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_identities_that_differ_in_one_field_never_share_a_namespace(
    change: dict[str, Any],
) -> None:
    assert digest(identity(**change)) != digest(identity())
    assert digest(identity()) == digest(identity())  # and the same one is stable


def factors(model: Path, **fields: Any) -> dict[str, str]:
    config = make_vllm_config(model, {}, **fields)
    return dict(numerics_factors(config))


BF16 = {"model_fields": {"dtype": "bfloat16"}}


@pytest.mark.parametrize(
    ("base", "fields", "factor"),
    [
        # RoPE scaling through hf_overrides: the HF config (and the overrides) differ
        (
            {},
            {
                "model_fields": {
                    "hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
                }
            },
            "hf_config",
        ),
        ({}, BF16, "dtype"),
        ({}, {"cache_fields": {"cache_dtype": "fp8_e4m3"}}, "kv_cache_dtype"),
        # (vLLM quantizes online to fp8 only from 16-bit weights)
        (
            BF16,
            {"model_fields": {"dtype": "bfloat16", "quantization": "fp8_per_tensor"}},
            "quantization",
        ),
    ],
    ids=["rope-scaling-override", "model-dtype", "kv-cache-fp8", "quantization-fp8"],
)
def test_vllm_configs_that_differ_in_one_setting_get_other_numerics(
    model: Path, base: dict[str, Any], fields: dict[str, Any], factor: str
) -> None:
    plain, changed = factors(model, **base), factors(model, **fields)
    assert {k for k in plain if plain[k] != changed[k]} >= {factor}
    ns = [digest(identity(numerics=tuple(sorted(f.items())))) for f in (plain, changed)]
    assert ns[0] != ns[1]


def test_the_backend_is_the_one_vllm_selects_not_auto(model: Path) -> None:
    config = make_vllm_config(model, {})
    assert config.attention_config.backend is None  # configured: auto
    name = selected_backend(config, head_size=16, num_heads=4)
    assert name.startswith("CPU_ATTN:"), name  # what vLLM's CPU platform picks, with its ISA


def test_a_hub_model_is_named_by_the_commit_its_revision_resolves_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--model"

    def publish(commit: str) -> None:  # as a download of "main" at that commit leaves it
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)

    publish(COMMIT_A)
    assert pinned_revision("org/model", None) == COMMIT_A
    before = digest(identity(revision="main"))
    publish(COMMIT_B)  # main moved: other weights under the same name
    assert pinned_revision("org/model", "main") == COMMIT_B
    assert digest(identity(revision="main")) != before
    assert pinned_revision("org/other", COMMIT_A) == COMMIT_A  # a pinned commit needs no cache
    with pytest.raises(ValueError, match="--revision"):
        pinned_revision("org/absent", "main")


def test_a_local_model_is_named_by_its_weights(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights one")
    ident = identity(model=str(folder), revision=None)
    before = digest(ident)
    (folder / "model.safetensors").write_bytes(b"weights two")
    assert digest(ident) != before


def kv_config(*specs: Any):  # vLLM's KVCacheConfig, one group per spec
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_layouts_a_page_cannot_hold_are_refused_at_start(model: Path) -> None:
    """Pipeline parallelism (layers on other ranks), MLA (one latent, not K and V) and
    hybrid models (sliding-window or Mamba groups beside full attention): vLLM does not
    start with our connector, and says why."""
    import torch
    from vllm.config import ParallelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    from asynchicache.integrations.vllm.spec import VllmKVSpec

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32)
    config = make_vllm_config(model, {})
    assert VllmKVSpec.from_vllm(config, kv_config(full)).num_kv_heads == 2  # the plain case
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="one full-attention KV cache group"):
        VllmKVSpec.from_vllm(config, kv_config(mla))
    window = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=64
    )
    with pytest.raises(ValueError, match="one full-attention KV cache group"):
        VllmKVSpec.from_vllm(config, kv_config(full, window))
    config.parallel_config = ParallelConfig(pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        VllmKVSpec.from_vllm(config, kv_config(full))
