"""The namespace of KV pages computed by vLLM: model, numerics, layout and engine.

Pages computed by vLLM and by our own engine never mix, nor do pages of two
vLLM versions, devices, attention backends (the one vLLM selected, not the
configured "auto"), tensor-parallel sizes, KV dtypes, page sizes or models,
nor of two configs that differ in anything else that changes the K/V numbers
(`ModelIdentity.numerics`, read by numerics.py). The model is named by a
fingerprint of its weights and config when it is a local folder or file (a
re-exported or fine-tuned checkpoint under the same path is a new namespace),
else by its name and the commit its revision resolves to (a hub model that
cannot be pinned is refused at start). Each request's `cache_salt` and LoRA
adapter then root its own chains (request_names.py), so tenants never share a
page.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import xxhash

from asynchicache.common.keys import KV_LAYOUT_VERSION, Namespace

ENGINE = "vllm"
# vLLM's arithmetic is named by its version, device and backend in the engine marker;
# this counts changes of how *we* turn its blocks into pages (2: CPU_ATTN's K is read
# transposed, as its kernel stores it; pages of version 1 held it scrambled).
NUMERICS_VERSION = 2
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_FULL_HASH_BYTES = 1 << 30  # larger files are hashed by samples
_SAMPLE_BYTES = 1 << 20
_SAMPLES = 64
_COMMIT = re.compile(r"[0-9a-f]{40}")


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
    attention_backend: str  # the backend vLLM selected (CPU_ATTN:vec, FLASH_ATTN, ...)
    kv_dtype: str  # the KV cache tensors' dtype, e.g. float32, bfloat16, uint8
    block_size: int
    # Everything else in vLLM's config that changes the K/V numbers (numerics.py):
    # quantization, model dtype, KV cache dtype (its fp8 scales come with the weights
    # and config), the HF config after hf_overrides (RoPE scaling, ...), compilation.
    numerics: tuple[tuple[str, str], ...] = ()
    tp_size: int = 1  # a page holds every rank's heads (each rank copies its own)

    @property
    def engine_marker(self) -> str:
        return (
            f"{ENGINE}-{self.vllm_version}/{self.device}/{self.attention_backend}"
            f"/block{self.block_size}/tp{self.tp_size}"
        )

    @property
    def numerics_digest(self) -> str:
        digest = xxhash.xxh3_128()
        for key, value in sorted(self.numerics):
            digest.update(key.encode() + b"=" + value.encode() + b"\x00")
        return digest.hexdigest()


def weights_fingerprint(model: str, revision: str | None) -> str:
    """xxh3-128 of a local model's config and weight files; for a hub model, the
    commit its revision resolves to in the local Hugging Face cache. A hub model
    whose weights cannot be pinned to a commit cannot be named: ValueError."""
    path = Path(model)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(
            p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES or p.name == "config.json"
        )
    else:
        return f"{model}@{pinned_revision(model, revision)}"
    digest = xxhash.xxh3_128()
    for file in files:
        digest.update(file.name.encode() + b"\x00")
        digest.update(content_digest(file))
    return digest.hexdigest()


def pinned_revision(model: str, revision: str | None) -> str:
    """The commit of hub model `model` at `revision` (a branch such as main moves)."""
    if revision and _COMMIT.fullmatch(revision):
        return revision
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(model, revision=revision, local_files_only=True)
    except Exception as exc:  # not in the local cache, no hub client, ...
        raise ValueError(
            f"AsynchicacheConnector cannot pin the weights of {model!r} at revision "
            f"{revision or 'main'!r} to a commit ({exc}); pass --revision <commit> or a "
            "local model folder"
        ) from exc
    commit = Path(folder).name
    if not _COMMIT.fullmatch(commit):
        raise ValueError(f"unexpected Hugging Face snapshot folder {folder} for {model!r}")
    return commit


def vllm_namespace(identity: ModelIdentity, page_size: int) -> Namespace:
    """The unsalted namespace every page of this vLLM instance lives in."""
    fingerprint = weights_fingerprint(identity.model, identity.revision)
    return Namespace(
        model_fingerprint=f"{identity.model}|{fingerprint}|{identity.numerics_digest}",
        dtype=identity.kv_dtype,
        page_size=page_size,
        layout_version=KV_LAYOUT_VERSION,
        engine=identity.engine_marker,
        numerics_version=NUMERICS_VERSION,
    )
