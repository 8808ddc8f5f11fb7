"""What the HTTP process knows of the model: its tokenizer and shape, without the weights.

The engine process loads the weights; the HTTP process only tokenizes and
detokenizes, so it reads the tokenizer and the model config from the same
files (GGUF metadata or a Hugging Face folder) in well under a second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from asynchicache.model.default_model import default_model_path
from asynchicache.model.gguf import GGUFFile
from asynchicache.model.model_config import ModelConfig
from asynchicache.model.registry import get_architecture
from asynchicache.model.tokenizer import Tokenizer
from asynchicache.server.guards.bounded_tokenizer import NORMALIZED_SHRINK, BoundedTokenizer


@dataclass(frozen=True)
class Frontend:
    tokenizer: Tokenizer
    config: ModelConfig

    def max_model_len(self, limit: int | None) -> int:
        """The context length the engine enforces (`--max-model-len` caps the model's)."""
        return min(limit or self.config.max_position, self.config.max_position)

    def max_token_bytes(self) -> int:
        """The most bytes of text one token may stand for (server/guards/bounded_tokenizer.py):
        the longest vocabulary entry as UTF-8 (an overestimate for byte-level and
        SentencePiece vocabularies, whose entries spell bytes and spaces in longer
        characters), times NORMALIZED_SHRINK when a normalizer may fold the text."""
        backend = self.tokenizer.backend
        longest = max(len(t.encode("utf-8")) for t in backend.get_vocab(with_added_tokens=True))
        return longest * (NORMALIZED_SHRINK if backend.normalizer is not None else 1)

    def bounded_tokenizer(self, max_model_len: int) -> BoundedTokenizer:
        """The tokenizer that refuses, untokenized, a text longer than the context."""
        return BoundedTokenizer(self.tokenizer, max_model_len, self.max_token_bytes())

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K and V per token over all layers (sizes the host tier from a token count)."""
        from asynchicache.model.loader import DTYPES  # torch: only when sizing by tokens

        c = self.config
        itemsize = DTYPES[dtype].itemsize
        return c.num_layers * 2 * c.num_kv_heads * c.head_dim * itemsize


def _resolve(model: str | None) -> Path:
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    if not path.exists():
        raise FileNotFoundError(f"--model {path} does not exist")
    return path


def load_frontend(model: str | None) -> Frontend:
    """Tokenizer and config of `model` (a HF folder, a GGUF file, or None for the default)."""
    path = _resolve(model)
    if path.is_file():
        gguf = GGUFFile(path)
        return Frontend(Tokenizer.from_gguf(gguf.vocab()), gguf.model_config())
    raw = json.loads((path / "config.json").read_text())
    names = raw.get("architectures") or []
    if not names:
        raise ValueError(f"{path}/config.json names no architecture")
    config = get_architecture(names[0]).model_config(raw)
    return Frontend(Tokenizer.from_hf_folder(path), config)
