"""Reading a GGUF file: model config, dequantized weights (HF names) and vocabulary.

Weights are dequantized to float32 with gguf's own `quants` module and renamed
to Hugging Face names, so one weight loader serves both formats. llama.cpp's
converter interleaves the rows of Llama's Q and K projections (for its rotary
kernel); `_unpermute` restores the Hugging Face "rotate half" order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader
from gguf.quants import dequantize

from asynchicache.model.model_config import ModelConfig, RopeConfig, RopeType, eos_ids_from
from asynchicache.model.registry import Architecture, get_architecture
from asynchicache.model.tokenizer import GGUFVocab

if TYPE_CHECKING:  # the HTTP process reads the vocabulary and config without torch
    import torch

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_TOKENS = "tokenizer.ggml.tokens"
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class _PlainViewReader(GGUFReader):
    """gguf's reader, slicing a plain ndarray view of its memory map.

    `GGUFReader` slices its `np.memmap` once per string of the vocabulary
    (~250,000 slices for a 49k-token model), and every memmap slice runs numpy's
    subclass hooks: 2.4 s to open SmolLM2, paid by the HTTP process and the engine
    at each start. The same slices of a base-class view of the same mapping cost
    0.6 s and read the same bytes."""

    def _get(
        self,
        offset: int,
        dtype: npt.DTypeLike,
        count: int = 1,
        override_order: Literal["I", "S", "<"] | None = None,
    ) -> npt.NDArray[Any]:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        array = plain[offset:end].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return array.view(array.dtype.newbyteorder(order))


class GGUFFile:
    """One opened GGUF file (memory-mapped; tensors are read lazily)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = _PlainViewReader(str(path))
        self.gguf_arch = str(self.value("general.architecture"))
        self.arch: Architecture = get_architecture(self.gguf_arch)

    def value(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.value(f"{self.gguf_arch}.{key}", default)

    def model_config(self) -> ModelConfig:
        heads = int(self.arch_value("attention.head_count"))
        hidden = int(self.arch_value("embedding_length"))
        layers = int(self.arch_value("block_count"))
        names = {t.name for t in self.reader.tensors}
        window = self.arch_value("attention.sliding_window")
        return ModelConfig(
            arch=self.arch.name,
            vocab_size=int(self.arch_value("vocab_size") or len(self.value(_TOKENS))),
            hidden_size=hidden,
            intermediate_size=int(self.arch_value("feed_forward_length")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(self.arch_value("attention.head_count_kv") or heads),
            head_dim=int(self.arch_value("attention.key_length") or hidden // heads),
            rms_norm_eps=float(self.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
            rope=self._rope(),
            max_position=int(self.arch_value("context_length", 2048)),
            tie_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names,
            o_bias="blk.0.attn_output.bias" in names,
            mlp_bias="blk.0.ffn_up.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            sliding_windows=(None if window is None else int(window),) * layers,
            bos_token_id=self.value("tokenizer.ggml.bos_token_id"),
            eos_token_ids=self.eos_token_ids(),
        )

    def _rope(self) -> RopeConfig:
        scaling = self.arch_value("rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ValueError(
                f"{self.path.name}: GGUF rope scaling {scaling!r} is not supported; "
                "known: none, linear, per-frequency factors (rope_freqs.weight)"
            )
        factors = self._rope_factors()
        return RopeConfig(
            theta=float(self.arch_value("rope.freq_base", 10000.0)),
            rope_type=RopeType.LINEAR if scaling == "linear" else RopeType.DEFAULT,
            factor=float(self.arch_value("rope.scaling.factor", 1.0) or 1.0),
            freq_factors=None if factors is None else tuple(float(f) for f in factors),
        )

    def _rope_factors(self) -> np.ndarray | None:
        """llama.cpp stores Llama 3.1 rope scaling as one divisor per frequency."""
        for tensor in self.reader.tensors:
            if tensor.name == "rope_freqs.weight":
                return dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        return None

    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_ids_from(
            self.value("tokenizer.ggml.eos_token_id"),
            self.value("tokenizer.ggml.eot_token_id"),
            self.value("tokenizer.ggml.eom_token_id"),
        )

    def vocab(self) -> GGUFVocab:
        return GGUFVocab(
            model=str(self.value("tokenizer.ggml.model")),
            pre=str(self.value("tokenizer.ggml.pre", "default")),
            tokens=self.value(_TOKENS),
            token_types=self.value("tokenizer.ggml.token_type", []),
            merges=self.value("tokenizer.ggml.merges", []),
            bos_token_id=self.value("tokenizer.ggml.bos_token_id"),
            eos_token_ids=self.eos_token_ids(),
            unk_token_id=self.value("tokenizer.ggml.unknown_token_id"),
            pad_token_id=self.value("tokenizer.ggml.padding_token_id"),
            add_bos_token=bool(self.value("tokenizer.ggml.add_bos_token", False)),
            chat_template=self.value("tokenizer.chat_template"),
        )

    def hf_tensors(self, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, float32 tensor) for every weight, dequantized one at a time."""
        import torch

        for tensor in self.reader.tensors:
            name = _hf_name(tensor.name)
            if name is None:
                continue
            array = dequantize(tensor.data, tensor.tensor_type)  # numpy, reversed ggml dims
            weight = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
            if self.arch.gguf_permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
                weight = _unpermute(weight, config.num_heads)
            elif self.arch.gguf_permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
                weight = _unpermute(weight, config.num_kv_heads)
            yield name, weight


def _hf_name(gguf_name: str) -> str | None:
    match = _BLOCK.match(gguf_name)
    if match is not None:
        index, kind, suffix = match.groups()
        mapped = _LAYER_TENSORS.get(kind)
        return None if mapped is None else f"model.layers.{index}.{mapped}.{suffix}"
    stem, _, suffix = gguf_name.rpartition(".")
    mapped = _GLOBAL_TENSORS.get(stem)
    return None if mapped is None else f"{mapped}.{suffix}"


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave: rows (pair, half) -> (half, pair)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    # [heads, head_dim/2, 2, ...] -> [heads, 2, head_dim/2, ...]
    return weight.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)
