"""How a vLLM request's pages are named, or why they cannot be.

vLLM's own block hashes cover a block's tokens, the request's LoRA adapter,
the multimodal items whose placeholder tokens the block holds (content hash
and offset), the `cache_salt` and prompt embeddings
(`vllm/v1/core/kv_cache_utils.py::generate_block_hash_extra_keys`). Our names
cover at least as much:

    root = H(namespace with the request's cache_salt)
    root = H(root || "lora" || fingerprint of the adapter's files)    LoRA requests
    h_i  = H(h_{i-1} || tokens of page i)                               text pages
    h_i  = H(h_{i-1} || tokens of page i || "mm" || (item hash, offset in page)...)
                                                                        pages with placeholders

An adapter is named by the content of its files, not by its name or id: a
restart with the same adapter files hits, another adapter loaded under the same
name does not. What cannot be named is refused (no lookup, no save) and counted
by its reason (`REFUSALS`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from asynchicache.common.keys import Namespace
from asynchicache.integrations.vllm.block_lookup import MMSpan, RequestChain
from asynchicache.integrations.vllm.namespace import content_digest

if TYPE_CHECKING:
    from vllm.v1.request import Request

# Why a request's pages are not cached (the `refused_<reason>` counters).
REFUSALS = (
    "prompt_embeds",  # the prompt is embeddings, not token ids
    "lora_unreadable",  # the adapter's files cannot be read to fingerprint them
    "mm_unnamed",  # a multimodal item without a content hash
    "backend_mismatch",  # vLLM's workers run another attention backend than the namespace names
)


@dataclass(frozen=True)
class Refusal:
    reason: str

    def __post_init__(self) -> None:
        if self.reason not in REFUSALS:
            raise ValueError(f"unknown refusal {self.reason!r}; known: {REFUSALS}")


class AdapterFingerprints:
    """xxh3-128 of a LoRA adapter's files, kept while their sizes and times stay."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple, str]] = {}

    def fingerprint(self, path: str) -> str | None:
        """The adapter at `path` (a folder or one file); None when it cannot be read."""
        try:
            files = _adapter_files(Path(path))
            if not files:
                return None
            stamp = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
            known = self._known.get(path)
            if known is not None and known[0] == stamp:
                return known[1]
            digest = xxhash.xxh3_128()
            for file in files:
                digest.update(file.name.encode() + b"\x00")
                digest.update(content_digest(file))
        except OSError:
            return None
        self._known[path] = (stamp, digest.hexdigest())
        return digest.hexdigest()


def _adapter_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith("."))


class RequestNamer:
    """Names the pages of requests in one namespace (see the module docstring)."""

    def __init__(self, namespace: Namespace, page_size: int) -> None:
        self.namespace = namespace
        self.page_size = page_size
        self.adapters = AdapterFingerprints()
        self.refuse_all: Refusal | None = None  # nothing in this namespace can be named

    def chain(self, request: Request) -> RequestChain | Refusal:
        """A fresh chain for `request`'s pages, or why there can be none."""
        if self.refuse_all is not None:
            return self.refuse_all
        if getattr(request, "prompt_embeds", None) is not None:
            return Refusal("prompt_embeds")
        salt = request.cache_salt or ""
        root = (self.namespace.with_salt(salt) if salt else self.namespace).digest()
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            fingerprint = self.adapters.fingerprint(os.fspath(lora.lora_path))
            if fingerprint is None:
                return Refusal("lora_unreadable")
            root = xxhash.xxh3_128_digest(root + b"\x00lora\x00" + fingerprint.encode())
        spans = mm_spans(getattr(request, "mm_features", None) or ())
        if spans is None:
            return Refusal("mm_unnamed")
        return RequestChain(root, self.page_size, spans)


def mm_spans(features: Sequence) -> tuple[MMSpan, ...] | None:
    """vLLM's multimodal features as spans of placeholder tokens; None if one has no
    content hash."""
    out = []
    for feature in features:
        identifier = getattr(feature, "identifier", None)
        if not identifier:
            return None
        pos = feature.mm_position
        out.append(MMSpan(int(pos.offset), int(pos.length), str(identifier)))
    return tuple(sorted(out, key=lambda s: s.offset))
