"""GGUF files of each architecture, written here with gguf's own writer from the tiny
HF checkpoints (float32, Llama's Q/K rows interleaved the way llama.cpp's converter
does), load to the same model as the HF folder; Qwen2's also matches transformers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from hf_reference import hf_logits, hf_model
from safetensors.torch import load_file
from test_models import assert_logits_close, our_logits
from tokenizers import pre_tokenizers

from asynchicache.model.loader import load_model

GGUF_ARCH = {"llama-untied-bias": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, index, module = stem.split(".", 3)
        return f"blk.{index}.{LAYER_NAMES[module]}.{suffix}"
    return f"{GLOBAL_NAMES[stem]}.{suffix}"


def interleave(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order: per head, rows (half, pair) -> (pair, half).
    It reorders q/k biases as well as weights."""
    shape = weight.shape
    per_head = weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:])
    return per_head.swapaxes(1, 2).reshape(shape)


def write_gguf(folder: Path, arch: str, out: Path) -> None:
    import json

    cfg = json.loads((folder / "config.json").read_text())
    writer = GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*alphabet, "<|endoftext|>", *(f"<x{i}>" for i in range(1024 - 257))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] + [4] * (1024 - 257))
    writer.add_token_merges([])
    writer.add_eos_token_id(256)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        array = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in name:
            array = interleave(array, cfg["num_attention_heads"])
        elif arch == "llama" and ".k_proj." in name:
            array = interleave(array, cfg["num_key_value_heads"])
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("name", list(GGUF_ARCH))
def test_gguf_loads_the_same_model_as_the_folder(
    name: str, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / f"{name}.F32.gguf"
    write_gguf(tiny_checkpoints[name], GGUF_ARCH[name], path)
    from_gguf, from_folder = load_model(path), load_model(tiny_checkpoints[name])
    assert from_gguf.name == name
    assert from_gguf.config.tie_embeddings == from_folder.config.tie_embeddings
    assert from_gguf.tokenizer.eos_token_ids == (256,)
    prompt = torch.randint(0, 1024, (25,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = our_logits(from_gguf, prompt, prefill=20)
    ref = our_logits(from_folder, prompt, prefill=20)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_tiny_qwen2_gguf_matches_transformers(
    tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / "qwen2.gguf"
    write_gguf(tiny_checkpoints["qwen2"], "qwen2", path)
    hf = hf_model(path)
    prompt = torch.randint(0, 1024, (25,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = our_logits(load_model(path), prompt, prefill=20)
    assert_logits_close(ours, hf_logits(hf, prompt)[19:])
