"""Our model's logits against Hugging Face transformers on the same weights.

Each tiny architecture is prefilled for part of a prompt and then fed the rest
one token at a time (teacher forcing), so both the prefill and the decode paths
are compared, position by position, with transformers' full forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import make_pool
from hf_reference import hf_logits, hf_model
from tiny_specs import TINY_SPECS

from asynchicache.model import native
from asynchicache.model.loader import LoadedModel, load_model
from asynchicache.model.runner import ForwardBatch, ModelRunner, attention_kernel

PAGE = 8
# torch's attention, and every build of the native kernels this CPU runs (AVX-512 and AVX2).
ATTENTIONS = ["torch", *(f"kernel-{isa}" for isa in native.runnable_isas())]


def our_logits(
    loaded: LoadedModel, prompt: list[int], prefill: int, attention: str = "torch"
) -> torch.Tensor:
    """[len(prompt) - prefill + 1, vocab]: logits after prompt[:prefill], then per token,
    attending with torch or with a build of the native kernels (`attention`: kernel-ISA)."""
    kernel = None
    if attention.startswith("kernel"):
        isa = attention.partition("-")[2] or None
        cpu = torch.device("cpu")
        kernel = attention_kernel(loaded.config, torch.float32, cpu, use=True, isa=isa)
    runner = ModelRunner(loaded.model, make_pool(loaded, 16, PAGE), PAGE, kernel)
    table = [9, 3, 12, 0, 7, 15, 1, 4, 11, 2]  # scattered on purpose
    rows = [runner.forward(ForwardBatch([prompt[:prefill]], [0], [table]))[0]]
    for pos in range(prefill, len(prompt)):
        rows.append(runner.forward(ForwardBatch([[prompt[pos]]], [pos], [table]))[0])
    return torch.stack(rows)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Within float32 noise relative to the logits' scale."""
    scale = ref.abs().max().item()
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4 * max(scale, 1.0))
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("name", list(TINY_SPECS))
def test_tiny_architecture_matches_transformers(
    name: str, attention: str, tiny_checkpoints: dict[str, Path]
) -> None:
    folder = tiny_checkpoints[name]
    loaded = load_model(folder)
    hf = hf_model(folder)
    prompt = torch.randint(0, 1024, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(hf, prompt)[29:]  # positions 29..39
    ours = our_logits(loaded, prompt, prefill=30, attention=attention)
    assert_logits_close(ours, ref)


def test_tiny_configs_cover_each_feature(tiny_checkpoints: dict[str, Path]) -> None:
    configs = {name: load_model(path).config for name, path in tiny_checkpoints.items()}
    assert configs["llama3-rope-tied"].rope.rope_type == "llama3"
    assert configs["llama3-rope-tied"].tie_embeddings
    assert configs["llama-untied-bias"].o_bias and configs["llama-untied-bias"].mlp_bias
    assert not configs["llama-untied-bias"].tie_embeddings
    assert configs["mistral-window"].sliding_windows == (16, 16)
    assert configs["qwen2"].qkv_bias and not configs["qwen2"].o_bias
    assert configs["qwen3"].qk_norm and configs["qwen3"].head_dim == 32


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_smollm2_gguf_matches_transformers(
    smollm: LoadedModel, hf_smollm: Any, attention: str
) -> None:
    """Within float32 noise of transformers, the same greedy token at every position, with
    torch's attention and with every native build (the AVX2 one too, on an AVX-512 host)."""
    hf = hf_smollm  # the session's (tests/conftest.py): loading it takes ~10 s
    text = "The history of Paris spans more than two thousand years; in 1889 the Eiffel Tower"
    prompt = smollm.tokenizer.encode(text)
    assert 15 <= len(prompt) <= 40
    ref = hf_logits(hf, prompt)[len(prompt) - 6 :]
    ours = our_logits(smollm, prompt, prefill=len(prompt) - 5, attention=attention)
    assert_logits_close(ours, ref)
