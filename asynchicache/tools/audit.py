"""Deep audit of a disk cache folder: recompute the KV of stored pages and compare.

    asynchicache cache verify --deep --disk-cache-dir DIR [--model M] [--sample N] [--json]

A checksum proves a file holds the bytes that were written; it cannot prove
those bytes are the KV of the page's tokens (a late store that checksummed a
reused slot publishes another page's KV under a valid checksum). This audit
can: every page header names its tokens and its parent page's hash, so each
page whose whole chain is in the folder (parent by parent, back to the
namespace digest) has a known prompt. The model prefills that prompt with no
cache at all (a private pool, nothing read from any tier) and the page's
stored K/V must equal the recomputed one within `tolerance` (max absolute
difference; recomputing in other chunks or threads moves float32 K/V by
~1e-6, a wrong page by ~1).

Each page ends up in exactly one bucket (they add up to `pages`):
    checked       recomputed and compared; `mismatched` counts those that differ (or
                  whose header's tokens and parent do not hash to the page's name)
    corrupt       fails the reader's checks (header, length, checksum): another fault
    unverifiable  its chain cannot be rebuilt (a missing or unknown parent, a salted
                  chain), it is of another page format version (older code: a miss
                  today, evicted first as its namespace is unused), or it belongs to
                  another model, dtype, engine or numerics than `--model` computes
    skipped       not drawn by `--sample`
Corrupt and mismatched files are removed (as a reader would) unless `keep`.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from asynchicache.common.keys import (
    NATIVE8_NUMERICS_VERSION,
    NATIVE_NUMERICS_VERSION,
    NUMERICS_VERSION,
    Namespace,
    chain_hashes,
    namespace_digest,
)
from asynchicache.model.loader import LoadedModel, load_model
from asynchicache.model.native import KernelThreads
from asynchicache.model.op_choice import OpChoice
from asynchicache.model.runner import (
    ForwardBatch,
    ModelRunner,
    attention_kernel,
    numerics_version,
)
from asynchicache.storage.base import PageLayout
from asynchicache.storage.disk.disk_admin import (
    OLD_FORMAT,
    namespace_dirs,
    page_files,
    read_page_file,
    read_page_header,
)
from asynchicache.storage.disk.disk_backend import parse_page_file_name
from asynchicache.storage.header import PageHeader

DEFAULT_TOLERANCE = 1e-3
# The native kernels' numerics versions and the build that computes each (None: the
# host's own, 16 lanes unless it is an AVX2 host; `_kernel` checks it).
_NATIVE_BUILDS: dict[int, str | None] = {NATIVE_NUMERICS_VERSION: None,
                                         NATIVE8_NUMERICS_VERSION: "avx2"}  # fmt: skip
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class AuditConfig:
    root: Path
    model: str | None = None  # None: the default model
    sample: int | None = None  # check at most this many pages (drawn at random)
    tolerance: float = DEFAULT_TOLERANCE
    keep: bool = False  # report only; do not remove corrupt or mismatched files
    device: str = "cpu"
    chunk_tokens: int = 512  # prefill chunk, as the engine's --chunked-prefill-size
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.sample is not None and self.sample <= 0:
            raise ValueError(f"--sample must be positive, got {self.sample}")
        if not self.tolerance >= 0:
            raise ValueError(f"--tolerance must be >= 0, got {self.tolerance}")


@dataclass
class AuditReport:
    root: str
    model: str
    tolerance: float
    pages: int = 0
    checked: int = 0
    mismatched: int = 0
    corrupt: int = 0
    unverifiable: int = 0
    skipped: int = 0
    max_abs_diff: float = 0.0
    removed: int = 0
    seconds: float = 0.0
    unverifiable_reasons: dict[str, int] = field(default_factory=dict)
    mismatched_files: list[str] = field(default_factory=list)
    corrupt_files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Page:
    path: Path
    header: PageHeader


class _Chains:
    """The pages of one namespace folder, linked by their headers' parent hashes."""

    def __init__(self, namespace: bytes, pages: dict[bytes, _Page], page_size: int) -> None:
        self.namespace = namespace
        self.root = namespace_digest(namespace)
        self.pages = pages
        self.page_size = page_size
        self._why: dict[bytes, str | None] = {}  # page -> why its chain breaks (None: whole)

    def broken(self, h: bytes) -> str | None:
        """Why `h`'s chain cannot be rebuilt, or None when it can (memoized)."""
        walk: list[bytes] = []
        cur = h
        while cur not in self._why:
            if len(walk) > len(self.pages):  # only a hash collision could make a cycle
                self._why[cur] = "its parents form a cycle"
                break
            walk.append(cur)
            why, parent = self.link(cur)
            if why is not None or parent == self.root:
                self._why[cur] = why
                walk.pop()
                break
            cur = parent
        verdict = self._why[cur]
        for page in reversed(walk):
            self._why[page] = verdict if verdict is None else "an ancestor's chain is broken"
        return self._why[h]

    def chain(self, h: bytes) -> list[bytes]:
        """Hashes from the first page to `h` (its chain must be whole)."""
        out = [h]
        while self.pages[out[-1]].header.parent != self.root:
            out.append(self.pages[out[-1]].header.parent)
        return out[::-1]

    def link(self, h: bytes) -> tuple[str | None, bytes]:
        """What is wrong with `h`'s own link to its parent (None: sound), and the parent."""
        page = self.pages.get(h)
        if page is None:
            return "a parent page is not in the folder", b""
        header = page.header
        if not header.parent:
            return "no parent hash in its header", b""
        if len(header.tokens) != self.page_size:
            return "not a full page", b""
        if chain_hashes(header.parent, header.tokens, self.page_size) != [h]:
            return "its name is not the hash of its parent and tokens", b""
        if header.parent != self.root and header.parent not in self.pages:
            return "a parent page is not in the folder", b""
        return None, header.parent


class DeepAudit:
    """Runs one audit over a folder (see the module docstring)."""

    def __init__(self, config: AuditConfig) -> None:
        self.config = config
        self.report = AuditReport(str(config.root), config.model or "default", config.tolerance)
        self._models: dict[str, LoadedModel] = {}
        # by dtype and numerics version: the native attention
        self._kernels: dict[tuple[str, int], KernelThreads | None] = {}
        self._unverifiable: Counter[str] = Counter()

    def run(self) -> AuditReport:
        t0 = time.monotonic()
        for ns_dir in namespace_dirs(self.config.root):
            self._audit_namespace(ns_dir)
        self.report.unverifiable = sum(self._unverifiable.values())
        self.report.unverifiable_reasons = dict(self._unverifiable)
        self.report.seconds = round(time.monotonic() - t0, 3)
        return self.report

    # -- one namespace folder ------------------------------------------------

    def _audit_namespace(self, ns_dir: Path) -> None:
        pages: dict[bytes, _Page] = {}
        for path in page_files(ns_dir):
            page_hash = parse_page_file_name(path.name)
            if page_hash is None:
                continue
            self.report.pages += 1
            header = read_page_header(path)
            if isinstance(header, str) and header.startswith(OLD_FORMAT):
                self._unverifiable[OLD_FORMAT] += 1  # a miss for today's code, not damage
            elif isinstance(header, str):
                self._corrupt(path, header)
            else:
                pages[page_hash] = _Page(path, header)
        by_namespace: dict[bytes, dict[bytes, _Page]] = {}
        for h, page in pages.items():
            by_namespace.setdefault(page.header.namespace, {})[h] = page
        for namespace, group in by_namespace.items():
            self._audit_group(namespace, group)

    def _audit_group(self, namespace: bytes, pages: dict[bytes, _Page]) -> None:
        why, loaded = self._model_for(namespace, next(iter(pages.values())).header.layout)
        if why is not None or loaded is None:
            for page in pages.values():
                self._unverifiable_or_corrupt(page, why or "no model")
            return
        ns = Namespace.decode(namespace)
        chains = _Chains(namespace, pages, ns.page_size)
        whole = []
        for h, page in pages.items():
            broken = chains.broken(h)
            if broken is None:
                whole.append(h)
            elif self._misnamed(chains, h):
                self.report.checked += 1
                self._mismatch(page.path, broken)  # its header's tokens are not its name's
            else:
                self._unverifiable_or_corrupt(page, broken)
        chosen = self._draw(whole)
        self.report.skipped += len(whole) - len(chosen)
        self._recompute(loaded, chains, chosen)

    @staticmethod
    def _misnamed(chains: _Chains, h: bytes) -> bool:
        """A page on a sound chain whose name is not the hash of its parent and tokens."""
        why, _ = chains.link(h)
        if why is None or "name is not the hash" not in why:
            return False
        parent = chains.pages[h].header.parent
        return parent == chains.root or (parent in chains.pages and chains.broken(parent) is None)

    def _model_for(
        self, namespace: bytes, layout: PageLayout
    ) -> tuple[str | None, LoadedModel | None]:
        """The model that computes this namespace's pages, or why there is none."""
        try:
            ns = Namespace.decode(namespace)
        except ValueError:
            return "a namespace of another version or engine", None
        if ns.dtype not in _TORCH_DTYPES:
            return f"dtype {ns.dtype} is not one the engine runs", None
        if ns.dtype not in self._models:
            self._models[ns.dtype] = load_model(self.config.model, ns.dtype, self.config.device)
        loaded = self._models[ns.dtype]
        ours = Namespace(loaded.fingerprint, ns.dtype, ns.page_size, cache_salt=ns.cache_salt,
                         numerics_version=ns.numerics_version)  # fmt: skip
        base, _ = OpChoice.from_version(ns.numerics_version)  # the kernel's, and the choice
        if base not in (NUMERICS_VERSION, *_NATIVE_BUILDS) or (
            base == NUMERICS_VERSION != ns.numerics_version
        ):
            return "another numerics version than this engine's", None
        native = base in _NATIVE_BUILDS
        if native and self._kernel(loaded, base) is None:
            return "pages of the native attention kernel, which cannot be built here", None
        if ours.encode() != namespace:
            return "another model, engine, numerics or KV layout than --model", None
        mc = loaded.config
        expected = (mc.num_layers, 2, ns.page_size, mc.num_kv_heads, mc.head_dim)
        if layout.shape != expected or layout.dtype != ns.dtype:
            return "a page layout this model does not make", None
        return None, loaded

    def _kernel(self, loaded: LoadedModel, version: int) -> KernelThreads | None:
        """The native attention for `loaded`'s dtype whose pages are of numerics `version`
        (None where it cannot be had: that build's lanes, on this CPU)."""
        weight = loaded.model.embed_tokens.weight
        key = (str(weight.dtype), version)
        if key not in self._kernels:
            kernel = attention_kernel(loaded.config, weight.dtype, weight.device,
                                      isa=_NATIVE_BUILDS[version])  # fmt: skip
            if kernel is not None and numerics_version(kernel) != version:
                kernel = None  # the host's build has the other lanes
            self._kernels[key] = kernel
        return self._kernels[key]

    def _draw(self, whole: list[bytes]) -> list[bytes]:
        n = self.config.sample
        if n is None or n >= len(whole):
            return whole
        rng = random.Random(self.config.seed)
        return rng.sample(whole, n)

    # -- recompute and compare ----------------------------------------------

    def _recompute(self, loaded: LoadedModel, chains: _Chains, chosen: list[bytes]) -> None:
        """Prefill each chosen page's chain once; compare every chosen page on it."""
        todo = set(chosen)
        order = sorted(chosen, key=lambda h: -len(chains.chain(h)))  # deepest chains first
        bar = tqdm(total=len(todo), desc="deep verify", unit="page", file=sys.stderr,
                   disable=not self.config.progress)  # fmt: skip
        try:
            for h in order:
                if h not in todo:
                    continue
                chain = chains.chain(h)
                kv = self._prefill(loaded, chains, chain)  # [pages, layers, 2, ps, kvh, hd]
                for i, page in enumerate(chain):
                    if page in todo:
                        todo.discard(page)
                        self._compare(chains.pages[page], kv[i])
                        bar.update(1)
        finally:
            bar.close()

    def _prefill(self, loaded: LoadedModel, chains: _Chains, chain: list[bytes]) -> torch.Tensor:
        tokens = [t for h in chain for t in chains.pages[h].header.tokens]
        mc = loaded.config
        weight = loaded.model.embed_tokens.weight
        pool = torch.zeros(len(chain), mc.num_layers, 2, chains.page_size, mc.num_kv_heads,
                           mc.head_dim, dtype=weight.dtype, device=weight.device)  # fmt: skip
        # The attention the pages were computed with (their namespace's numerics version).
        version = Namespace.decode(chains.namespace).numerics_version
        base, choice = OpChoice.from_version(version)  # ours or torch's per op, as computed
        native = base in _NATIVE_BUILDS
        runner = ModelRunner(loaded.model, pool, chains.page_size,
                             self._kernel(loaded, base) if native else None, choice)  # fmt: skip
        table = list(range(len(chain)))
        step = self.config.chunk_tokens
        for start in range(0, len(tokens), step):
            runner.forward(ForwardBatch([tokens[start : start + step]], [start], [table]))
        return pool.cpu()

    def _compare(self, page: _Page, computed: torch.Tensor) -> None:
        read = read_page_file(page.path, page.header.page_hash, page.path.parent.parent.name)
        if isinstance(read, str):
            self._corrupt(page.path, read)
            return
        header, payload = read
        dtype = _TORCH_DTYPES[header.layout.dtype]
        stored = torch.frombuffer(bytearray(payload), dtype=dtype).view(header.layout.shape)
        diff = float((stored.float() - computed.float()).abs().max())
        self.report.checked += 1
        self.report.max_abs_diff = max(self.report.max_abs_diff, diff)
        if not diff <= self.config.tolerance:  # NaN counts as a mismatch
            self._mismatch(page.path, f"max abs diff {diff:.3g}")

    def _unverifiable_or_corrupt(self, page: _Page, why: str) -> None:
        """One bucket per page: a page that fails the reader's checks is corrupt, even when
        it could not have been recomputed anyway (sampling reads no payloads)."""
        if self.config.sample is None:
            read = read_page_file(page.path, page.header.page_hash, page.path.parent.parent.name)
            if isinstance(read, str):
                self._corrupt(page.path, read)
                return
        self._unverifiable[why] += 1

    # -- outcomes -------------------------------------------------------------

    def _corrupt(self, path: Path, why: str) -> None:
        self.report.corrupt += 1
        self.report.corrupt_files.append(f"{path}: {why}")
        self._remove(path)

    def _mismatch(self, path: Path, why: str) -> None:
        self.report.mismatched += 1
        self.report.mismatched_files.append(f"{path}: {why}")
        self._remove(path)

    def _remove(self, path: Path) -> None:
        if not self.config.keep:
            path.unlink(missing_ok=True)
            self.report.removed += 1


def deep_verify(config: AuditConfig) -> AuditReport:
    return DeepAudit(config).run()


def audit_command(config: AuditConfig, as_json: bool) -> int:
    """`asynchicache cache verify --deep`; exit status 1 when a page is mismatched or corrupt."""
    report = deep_verify(config)
    print(json.dumps(asdict(report), indent=2) if as_json else render(report))
    return 1 if report.mismatched or report.corrupt else 0


def render(report: AuditReport) -> str:
    lines = [
        f"{report.root}: {report.pages} pages, deep-verified with {report.model} "
        f"in {report.seconds:.1f} s",
        f"  checked       {report.checked:8d}  (recomputed; equal within max abs diff "
        f"{report.tolerance:g})",
        f"  mismatched    {report.mismatched:8d}  (valid checksum, wrong KV)",
        f"  corrupt       {report.corrupt:8d}  (fails the checksum or header checks)",
        f"  unverifiable  {report.unverifiable:8d}",
        f"  skipped       {report.skipped:8d}  (not drawn by --sample)",
        f"  largest difference seen: {report.max_abs_diff:.3g} (tolerance {report.tolerance:g})",
    ]
    lines += [f"    {n:6d}  {why}" for why, n in sorted(report.unverifiable_reasons.items())]
    if report.removed:
        lines.append(f"  removed {report.removed} files")
    lines += [f"  mismatched: {m}" for m in report.mismatched_files[:20]]
    lines += [f"  corrupt: {c}" for c in report.corrupt_files[:20]]
    return "\n".join(lines)
