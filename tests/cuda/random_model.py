"""A SmolLM2-shaped Llama with random weights, for GPU machines (scripts/gpu-check.sh).

    python tests/cuda/random_model.py SOURCE DEST [--layers N]

SOURCE is a model folder with config.json and tokenizer files (what `asynchicache
model export-hf` writes; its weights are not read). The embedded SmolLM2 GGUF is
too large to carry to a GPU machine (64 MiB per call), so the CUDA tests and `bench
engine` there run this: SmolLM2's shapes (the same FLOPs and KV bytes per token),
weights drawn from a fixed seed and scaled so that logits have clear winners (greedy
comparisons between devices then mean something), float32 safetensors.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _weights(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """HF Llama weight names -> random tensors (norms near 1, matrices ~ 1/sqrt(fan-in))."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_dim, kv_dim = (
        config["num_attention_heads"] * head_dim,
        config["num_key_value_heads"] * head_dim,
    )

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    out = {
        "model.embed_tokens.weight": torch.randn(config["vocab_size"], hidden, generator=gen)
        * 0.15,
        "model.norm.weight": norm(),
    }
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        out |= {
            pre + "input_layernorm.weight": norm(),
            pre + "post_attention_layernorm.weight": norm(),
            pre + "self_attn.q_proj.weight": matrix(q_dim, hidden),
            pre + "self_attn.k_proj.weight": matrix(kv_dim, hidden),
            pre + "self_attn.v_proj.weight": matrix(kv_dim, hidden),
            pre + "self_attn.o_proj.weight": matrix(hidden, q_dim) * 0.5,
            pre + "mlp.gate_proj.weight": matrix(inter, hidden),
            pre + "mlp.up_proj.weight": matrix(inter, hidden),
            pre + "mlp.down_proj.weight": matrix(hidden, inter) * 0.5,
        }
    return out


def build(source: Path, dest: Path, layers: int | None = None, seed: int = 0) -> Path:
    """Write the random model into `dest` (config, tokenizer, model.safetensors)."""
    config = json.loads((source / "config.json").read_text())
    if config.get("tie_word_embeddings") is False:
        raise ValueError("expected a model with tied embeddings (SmolLM2's)")
    if layers is not None:
        config["num_hidden_layers"] = layers
    config.update(dtype="float32", torch_dtype="float32")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, dest / name)
    save_file(_weights(config, seed), str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="random_model.py", description=__doc__)
    p.add_argument("source", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a dry run)")
    args = p.parse_args(argv)
    print(build(args.source, args.dest, args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
