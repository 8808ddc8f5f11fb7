"""`asynchicache model export-hf`: the embedded GGUF as an HF folder that computes the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asynchicache.model.loader import LoadedModel, load_model
from asynchicache.tools.export_hf import export_hf


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf(tmp_path_factory.mktemp("smollm2-hf"))


def test_the_folder_has_what_vllm_and_transformers_load(exported: Path) -> None:
    names = {p.name for p in exported.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= names
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True


def test_same_config_tokens_template_and_weights_as_the_gguf(
    exported: Path, smollm: LoadedModel
) -> None:
    hf = load_model(exported)
    assert hf.config == smollm.config
    text = "The capital of France is Paris. 1234 naïve café!"
    assert hf.tokenizer.encode(text) == smollm.tokenizer.encode(text)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert hf.tokenizer.apply_chat_template(chat) == smollm.tokenizer.apply_chat_template(chat)
    assert hf.tokenizer.eos_token_ids == smollm.tokenizer.eos_token_ids
    # Every parameter bit-identical: the exported model computes what ours computes.
    want, got = smollm.model.state_dict(), hf.model.state_dict()
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_cli_writes_the_folder_and_refuses_a_non_gguf(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "asynchicache", "model", "export-hf"]
    bad = subprocess.run(
        [*run, str(tmp_path / "x"), "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "must be a .gguf file" in bad.stderr
