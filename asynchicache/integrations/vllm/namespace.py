"""The namespace of KV pages computed by vLLM: model, numerics, layout and engine.

Pages computed by vLLM and by our own engine never mix, nor do pages of two
vLLM versions, devices or attention backends (their numerics differ), KV
dtypes, page sizes or models. The model is named by a fingerprint of its
weights and config when it is a local folder or file (a re-exported or
fine-tuned checkpoint under the same path is a new namespace), else by its
name and revision. Each request's `cache_salt` then roots its own chains
(`Namespace.with_salt`), so tenants never share a page.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import xxhash

from asynchicache.cache.keys import KV_LAYOUT_VERSION, Namespace

ENGINE = "vllm"
# vLLM's arithmetic is named by its version, device and backend in the engine marker;
# this counts changes of how *we* turn its blocks into pages (2: CPU_ATTN's K is read
# transposed, as its kernel stores it; pages of version 1 held it scrambled).
NUMERICS_VERSION = 2
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_FULL_HASH_BYTES = 1 << 30  # larger files are hashed by samples
_SAMPLE_BYTES = 1 << 20
_SAMPLES = 64


def content_digest(path: Path) -> bytes:
    """Full xxh3 of the file up to 1 GiB; beyond, its size and 64 spread 1 MiB samples
    (so a multi-GB checkpoint fingerprints in well under a second)."""
    size = path.stat().st_size
    digest = xxhash.xxh3_128(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        if size <= _FULL_HASH_BYTES:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
            return digest.digest()
        step = (size - _SAMPLE_BYTES) // (_SAMPLES - 1)
        for i in range(_SAMPLES):
            f.seek(i * step)
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.digest()


@dataclass(frozen=True)
class ModelIdentity:
    """The model and runtime as vLLM runs them (all strings, for the namespace)."""

    model: str  # path or hub name
    revision: str | None
    vllm_version: str
    device: str  # cpu, cuda, ...
    attention_backend: str  # configured backend, or "auto"
    kv_dtype: str  # e.g. float32, bfloat16, fp8_e4m3
    block_size: int

    @property
    def engine_marker(self) -> str:
        return (
            f"{ENGINE}-{self.vllm_version}/{self.device}/{self.attention_backend}"
            f"/block{self.block_size}"
        )


def weights_fingerprint(model: str, revision: str | None) -> str:
    """xxh3-128 of a local model's config and weight files; else `name@revision`."""
    path = Path(model)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(
            p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json"
        )
    else:
        return f"{model}@{revision or 'main'}"
    digest = xxhash.xxh3_128()
    for file in files:
        digest.update(file.name.encode() + b"\x00")
        digest.update(content_digest(file))
    return digest.hexdigest()


def vllm_namespace(identity: ModelIdentity, page_size: int) -> Namespace:
    """The unsalted namespace every page of this vLLM instance lives in."""
    fingerprint = weights_fingerprint(identity.model, identity.revision)
    return Namespace(
        model_fingerprint=f"{identity.model}|{fingerprint}",
        dtype=identity.kv_dtype,
        page_size=page_size,
        layout_version=KV_LAYOUT_VERSION,
        engine=identity.engine_marker,
        numerics_version=NUMERICS_VERSION,
    )
