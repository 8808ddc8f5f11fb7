"""Loading a model: a Hugging Face folder or a GGUF file -> model, config, tokenizer.

    load_model(None)                      the embedded SmolLM2-135M-Instruct GGUF
    load_model("/models/Qwen3-0.6B")      config.json + *.safetensors + tokenizer.json
    load_model("/models/x.Q4_K_M.gguf")   weights dequantized to `dtype`

The fingerprint names the weights and config for the KV cache's namespace: an
xxh3-128 over the config and every tensor the loader hands to the model, whole
(name, dtype, shape and all of its bytes, after GGUF dequantization), so any
change to any weight, or to how a file is decoded, is another namespace. xxh3
runs at ~10 GB/s: a fraction of the time the same bytes take to load.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from asynchicache.model.default_model import default_model_path
from asynchicache.model.gguf import GGUFFile
from asynchicache.model.llama import LlamaForCausalLM
from asynchicache.model.model_config import ModelConfig
from asynchicache.model.registry import ARCHITECTURES, get_architecture
from asynchicache.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_QUANT_SUFFIX = re.compile(r"[.-](?:[IQ]?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with what the engine and the server need about it."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    fingerprint: str
    name: str
    path: Path
    dtype: str
    device: str

    @property
    def weight_bytes(self) -> int:
        """Bytes of every parameter (what a forward reads of the weights at least once)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())


def load_model(
    path: str | Path | None = None, dtype: str = "float32", device: str = "cpu"
) -> LoadedModel:
    """Load a Llama-family model from a HF folder or a GGUF file (None: the default)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    resolved = default_model_path() if path is None else Path(path)
    if resolved.is_dir() and not (resolved / "config.json").is_file():
        resolved = _single_gguf_in(resolved)
    if resolved.is_dir():
        return _load_hf_folder(resolved, dtype, device)
    if not resolved.is_file():
        raise FileNotFoundError(f"model path {resolved} does not exist")
    if resolved.suffix.lower() != ".gguf":
        raise ValueError(f"{resolved} is neither a Hugging Face folder nor a .gguf file")
    return _load_gguf(resolved, dtype, device)


def _single_gguf_in(folder: Path) -> Path:
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    found = ", ".join(sorted(p.name for p in folder.iterdir())[:12]) or "nothing"
    raise FileNotFoundError(
        f"{folder} is not a model folder: it needs config.json, *.safetensors and "
        f"tokenizer.json (or exactly one .gguf file); found: {found}"
    )


def _load_hf_folder(folder: Path, dtype: str, device: str) -> LoadedModel:
    raw = json.loads((folder / "config.json").read_text())
    names = raw.get("architectures") or []
    if not names:
        known = ", ".join(ARCHITECTURES)
        raise ValueError(f"{folder}/config.json names no architecture; known: {known}")
    config = get_architecture(names[0]).model_config(raw)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has config.json but no *.safetensors weights")
    tokenizer = Tokenizer.from_hf_folder(folder)
    model = _build(config, dtype, device)
    digests = TensorDigests()
    model.load_hf_weights(digests.watch(_safetensors_tensors(files)))
    return LoadedModel(
        model, config, tokenizer, digests.fingerprint(config), folder.name, folder, dtype, device
    )


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


def _load_gguf(path: Path, dtype: str, device: str) -> LoadedModel:
    gguf = GGUFFile(path)
    config = gguf.model_config()
    tokenizer = Tokenizer.from_gguf(gguf.vocab())
    model = _build(config, dtype, device)
    digests = TensorDigests()
    model.load_hf_weights(digests.watch(gguf.hf_tensors(config)))
    name = _QUANT_SUFFIX.sub("", path.stem)
    return LoadedModel(
        model, config, tokenizer, digests.fingerprint(config), name, path, dtype, device
    )


def _build(config: ModelConfig, dtype: str, device: str) -> LlamaForCausalLM:
    """An uninitialised model of `config` on `device` (weights are loaded next)."""
    arch = get_architecture(config.arch)
    with torch.device(device):
        model = arch.model_class(config).to(dtype=DTYPES[dtype])
    model.rotary.reset_buffers()  # stays float32: computed, not loaded
    return model.eval()


class TensorDigests:
    """Per-tensor xxh3-128 of the weights as they stream into the model (the fingerprint).

    Each tensor is hashed whole, with its name, dtype and shape; the fingerprint
    combines them in name order, so the order a checkpoint lists them in does not
    matter, and nothing is read twice.
    """

    def __init__(self) -> None:
        self._digests: dict[str, bytes] = {}

    def watch(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass `tensors` through, hashing each on the way."""
        for name, tensor in tensors:
            self._digests[name] = tensor_digest(name, tensor)
            yield name, tensor

    def fingerprint(self, config: ModelConfig) -> str:
        """xxh3-128 (hex) of the model config and every tensor seen."""
        digest = xxhash.xxh3_128()
        digest.update(json.dumps(asdict(config), sort_keys=True, default=str).encode())
        for name in sorted(self._digests):
            digest.update(self._digests[name])
        return digest.hexdigest()


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """xxh3-128 of a tensor's name, dtype, shape and every byte of its data."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    digest = xxhash.xxh3_128(f"{name}\0{flat.dtype}\0{tuple(tensor.shape)}\0".encode())
    digest.update(flat.view(torch.uint8).numpy().data)
    return digest.digest()
