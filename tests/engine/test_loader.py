"""Loading: the default model, names, fingerprints, dtypes and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_helpers import greedy_generate, make_pool

from asynchicache.model.loader import LoadedModel, default_model_path, load_model
from asynchicache.model.registry import get_architecture
from asynchicache.model.runner import ModelRunner


def test_default_is_the_embedded_smollm2(smollm: LoadedModel) -> None:
    assert smollm.path == default_model_path()
    assert smollm.name == "SmolLM2-135M-Instruct"
    c = smollm.config
    assert (c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "LlamaForCausalLM",
        30,
        576,
        9,
        3,
        64,
    )
    assert c.tie_embeddings and c.vocab_size == 49152 and c.rope.theta == 100000.0
    assert len(smollm.fingerprint) == 32


def test_smollm2_answers_the_france_question(smollm: LoadedModel) -> None:
    tok = smollm.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    runner = ModelRunner(smollm.model, make_pool(smollm, 8, 16), 16)
    out = greedy_generate(
        runner, prompt, [7, 2, 5, 0, 3, 6, 1, 4], 40, stop=lambda t: t in tok.eos_token_ids
    )
    answer = tok.decode(out)
    assert "Paris" in answer, answer
    assert out[-1] in tok.eos_token_ids  # a complete sentence, then end of turn


def test_fingerprint_is_stable_and_follows_the_weights(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    source = tiny_checkpoints["qwen2"]
    first, again = load_model(source), load_model(source)
    assert first.fingerprint == again.fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert load_model(copy).fingerprint == first.fingerprint  # content, not path
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert load_model(copy).fingerprint != first.fingerprint
    other = load_model(tiny_checkpoints["qwen3"])
    assert other.fingerprint != first.fingerprint


def test_fingerprint_is_every_tensor_whole_not_the_file_layout(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The same tensors in two shards fingerprint alike; a change deep inside any tensor
    (where a sampled file hash would not look) is another fingerprint."""
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoints["qwen2"]
    first = load_model(source)
    tensors = load_file(str(source / "model.safetensors"))
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    shutil.copytree(source, sharded, ignore=shutil.ignore_patterns("*.safetensors"))
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(sharded / "a.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(sharded / "b.safetensors"))
    assert load_model(sharded).fingerprint == first.fingerprint
    name = max(names, key=lambda n: tensors[n].numel())
    tensors[name].view(-1)[tensors[name].numel() // 2 + 1] += 1e-3
    (sharded / "b.safetensors").unlink()
    save_file({n: tensors[n] for n in names[half:]}, str(sharded / "b.safetensors"))
    save_file({n: tensors[n] for n in names[:half]}, str(sharded / "a.safetensors"))
    assert load_model(sharded).fingerprint != first.fingerprint


def test_bfloat16_loads_and_runs(tiny_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(tiny_checkpoints["llama3-rope-tied"], dtype="bfloat16")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.rotary.inv_freq.dtype == torch.float32
    runner = ModelRunner(loaded.model, make_pool(loaded, 4, 8), 8)
    assert len(greedy_generate(runner, [1, 2, 3, 4, 5], [0, 1, 2], 4)) == 4


def test_unknown_architecture_lists_the_known(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "gpt"
    shutil.copytree(tiny_checkpoints["qwen2"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"GPTNeoXForCausalLM.*known: LlamaForCausalLM, "
        r"MistralForCausalLM, Qwen2ForCausalLM",
    ):
        load_model(folder)
    with pytest.raises(ValueError, match=r"known:.*llama \(GGUF\)"):
        get_architecture("falcon")


@pytest.mark.parametrize("missing", ["model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, missing: str
) -> None:
    folder = tmp_path / "partial"
    shutil.copytree(tiny_checkpoints["qwen2"], folder)
    (folder / missing).unlink()
    pattern = "safetensors" if missing.endswith("safetensors") else "tokenizer.json"
    with pytest.raises(FileNotFoundError, match=pattern):
        load_model(folder)


def test_missing_weight_is_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "lacking"
    shutil.copytree(tiny_checkpoints["llama-untied-bias"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"], tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"lacks 2 weights: .*model\.layers\.1\.self_attn"
        r"\.k_proj\.weight.*lm_head\.weight",
    ):
        load_model(folder)


def test_not_a_model_folder(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FileNotFoundError, match=r"config.json.*found: notes.txt"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path, dtype="int8")
