"""Session fixtures for the model side: tiny random checkpoints and the SmolLM2 GGUF.

Each tiny checkpoint is a real Hugging Face folder (config.json, safetensors,
tokenizer files) written by transformers with random weights, once per session.
The reference models and tokenizers come from transformers itself.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import scheduler_rig
import torch
from engine_fixtures import checked_engines
from tiny_specs import TINY, TINY_SPECS

from asynchicache.engine.engine import Engine
from asynchicache.model.loader import LoadedModel, default_model_path, load_model


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (HF zeroes biases and sets norms to one)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.1
            param.copy_(1.0 + noise if "norm" in name else noise)


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm_gguf: Path) -> Any:
    """transformers' own tokenizer for the SmolLM2 GGUF (the reference)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name)


@pytest.fixture(scope="session")
def hf_tokenizer_dir(hf_gguf_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference tokenizer saved as a Hugging Face folder (tokenizer.json etc.)."""
    folder = tmp_path_factory.mktemp("hf-tokenizer")
    hf_gguf_tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(
    hf_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """name -> HF folder with random weights, for every entry of TINY_SPECS."""
    import transformers

    folders = {}
    for seed, (name, spec) in enumerate(TINY_SPECS.items()):
        config = getattr(transformers, spec.config_class)(**TINY, **spec.extra)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model, seed)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(folder))
        for item in hf_tokenizer_dir.iterdir():
            shutil.copy(item, folder / item.name)
        folders[name] = folder
    return folders


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints: dict[str, Path]) -> LoadedModel:
    return load_model(tiny_checkpoints["llama3-rope-tied"])


@pytest.fixture
def make_rig() -> Iterator[scheduler_rig.RigMaker]:
    """`scheduler_rig.make_rig`, every rig it made closed after the test."""
    made: list[scheduler_rig.Rig] = []

    def make(**kw: object) -> scheduler_rig.Rig:
        rig = scheduler_rig.make_rig(**kw)  # type: ignore[arg-type]
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test makes: each checked (integrity, no L1 page left in use) and closed."""
    yield from checked_engines()
