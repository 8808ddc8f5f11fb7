"""Other servers' cache flags, with their meanings: one table for `serve`, `--help` and the docs.

People come with launch scripts for SGLang HiCache, LightLLM's multi-level cache or the
seed's LightLLM hiradix PR. Each row names one of their flags (or environment
variables), what it becomes here, the values we implement and, for the others, what we do
instead. `launch/compat_resolve.py` reads the parsed rows back into our flags (the units
are theirs: SGLang's `--hicache-size` counts 10**9 bytes, LightLLM's sizes count GiB as
ours do); `docs/migrating.md` is generated from these rows (`launch/migrating.py`), so
the two cannot drift apart.

Kinds of rows:
* MAPPED: the same meaning here, written as one or more of our flags;
* SAME: spelled as ours already (listed for the docs only; argparse has it once);
* IGNORED: a performance knob of theirs with no counterpart and no effect on what is
  served or cached here (accepted, logged at start);
* REFUSED: a meaning this design cannot hold, refused with what to do instead (also
  values of a MAPPED row, in `refuses`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from asynchicache.settings.config_flags import finite_float


class Peer(StrEnum):
    SGLANG = "SGLang HiCache"
    LIGHTLLM = "LightLLM multi-level cache"
    SEED = "the seed (LightLLM's hiradix PR)"


class Kind(StrEnum):
    MAPPED = "mapped"
    SAME = "same"
    IGNORED = "ignored"
    REFUSED = "refused"


_NO_STORAGE = (
    "L3 here is a local folder (`file`) and L4 is Redis or Valkey (`redis`, `valkey`); "
    "share pages between machines through L4"
)
_NO_PARALLEL = (
    "one engine runs one model replica on one device; run one server per device and let "
    "them share L3/L4 (one cache service per machine, one Redis/Valkey for all)"
)
_L1_SIZE = "size L1 in tokens instead: --device-cache-tokens N"


@dataclass(frozen=True)
class CompatFlag:
    """One flag (or environment variable) of another server and its meaning here."""

    peer: Peer
    flag: str  # as they spell it: "--hicache-ratio", or "ENV:NAME" for an environment variable
    ours: str  # what it becomes here (help text and docs)
    kind: Kind = Kind.MAPPED
    value: type | None = None  # None: a switch
    accepts: tuple[str, ...] = ()  # the values taken (empty: any value of `value`)
    refuses: Mapping[str, str] = field(default_factory=dict)  # value -> what we do instead

    @property
    def is_env(self) -> bool:
        return self.flag.startswith("ENV:")

    @property
    def name(self) -> str:
        """The flag, or the environment variable's name."""
        return self.flag.removeprefix("ENV:")

    @property
    def dest(self) -> str:
        return "compat_" + self.name.lstrip("-").replace("-", "_").lower()

    @property
    def registered(self) -> bool:
        """Whether `serve` parses it (SAME rows are our own flags, env rows not flags)."""
        return self.kind is not Kind.SAME and not self.is_env


def _refusals(**by_value: str) -> Mapping[str, str]:
    return MappingProxyType(by_value)


SGLANG = (
    CompatFlag(Peer.SGLANG, "--enable-hierarchical-cache",
               "L2 (host) on; L3 only with --hicache-storage-backend (SGLang has no lower "
               "tier without one), so without it --no-disk-cache"),
    CompatFlag(Peer.SGLANG, "--hicache-ratio",
               "L2 holds this many times the tokens of L1 (--device-cache-tokens); SGLang's "
               "default 2.0 when any --hicache-* flag is given", value=float),
    CompatFlag(Peer.SGLANG, "--hicache-size",
               "L2 size in GB of 10**9 bytes, as SGLang counts (--host-cache-gb N*10**9/2**30); "
               "0: --hicache-ratio decides", value=int),
    CompatFlag(Peer.SGLANG, "--hicache-write-policy", "--write-policy (same values)",
               value=str, accepts=("write_through", "write_through_selective", "write_back")),
    CompatFlag(Peer.SGLANG, "--hicache-io-backend",
               "direct: L1<->L2 copies are batched torch index copies", value=str,
               accepts=("direct",), refuses=_refusals(
                   kernel="no custom copy kernels here; L1<->L2 moves whole pages with batched "
                   "torch index copies (SGLang's `direct`): pass direct or drop the flag",
                   kernel_ascend="no Ascend kernels here; pass direct or drop the flag")),
    CompatFlag(Peer.SGLANG, "--hicache-mem-layout",
               "page_first: L1 and L2 keep one page contiguous across all layers "
               "([pages, layers, 2, page_size, kv_heads, head_dim])", value=str,
               accepts=("page_first", "page_first_direct"), refuses=_refusals(
                   layer_first="L2 is page-first here (one page contiguous across all layers, "
                   "one copy per page); pass page_first or drop the flag",
                   page_first_kv_split="K and V of a page stay together here; pass page_first",
                   page_head="pages are not split by head here; pass page_first")),
    CompatFlag(Peer.SGLANG, "--hicache-storage-backend",
               "file: L3 in $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR (default /tmp/hicache); "
               "redis/valkey: L4 at $VALKEY_HOST:$VALKEY_PORT (behind an L3 folder, as L4 "
               "always is here)", value=str, accepts=("file", "redis", "valkey"),
               refuses=_refusals(**{name: f"no {name} backend: {_NO_STORAGE}" for name in (
                   "mooncake", "hf3fs", "nixl", "aibrix", "eic", "simm", "mori", "sim", "shm")},
                   dynamic="no backends loaded from a module: storage backends are registered "
                   "by name in asynchicache.storage; " + _NO_STORAGE)),
    CompatFlag(Peer.SGLANG, "--hicache-storage-prefetch-policy",
               "--prefetch-policy (same values); SGLang's default timeout when any "
               "--hicache-* flag is given", value=str,
               accepts=("best_effort", "wait_complete", "timeout")),
    CompatFlag(Peer.SGLANG, "--hicache-storage-backend-extra-config",
               "JSON (or @file.json): prefetch_threshold -> --min-load-tokens, "
               "prefetch_timeout_base -> --prefetch-timeout-s, prefetch_timeout_per_ki_token -> "
               "--prefetch-timeout-per-ki-token-s; hicache_storage_pass_prefix_keys and "
               "direct_io true hold already (pages are named by their whole prefix; O_DIRECT "
               "when aligned); host/port/db/password for redis/valkey", value=str),
    CompatFlag(Peer.SGLANG, "ENV:SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR",
               "--disk-cache-dir, with --hicache-storage-backend file", value=str),
    CompatFlag(Peer.SGLANG, "ENV:VALKEY_HOST",
               "--remote-url redis://HOST:PORT/DB with --hicache-storage-backend valkey|redis "
               "(also VALKEY_PORT, VALKEY_DB, VALKEY_PASSWORD)", value=str),
    CompatFlag(Peer.SGLANG, "--model-path", "--model", value=str),
    CompatFlag(Peer.SGLANG, "--max-total-tokens", "--device-cache-tokens (L1 in tokens)",
               value=int),
    CompatFlag(Peer.SGLANG, "--disable-radix-cache", "--no-prefix-cache"),
    CompatFlag(Peer.SGLANG, "--tp-size", "1 only: " + _NO_PARALLEL, value=int, accepts=("1",)),
    CompatFlag(Peer.SGLANG, "--tp", "1 only: " + _NO_PARALLEL, value=int, accepts=("1",)),
    CompatFlag(Peer.SGLANG, "--mem-fraction-static",
               "L1 is not sized from a share of device memory here; " + _L1_SIZE,
               Kind.REFUSED, value=float),
    CompatFlag(Peer.SGLANG, "--enable-metrics", "always on: GET /metrics", Kind.IGNORED),
    CompatFlag(Peer.SGLANG, "--enable-cache-report",
               "always on: usage.prompt_tokens_details.cached_tokens", Kind.IGNORED),
    *(CompatFlag(Peer.SGLANG, flag, "the same flag", Kind.SAME) for flag in (
        "--page-size", "--host", "--port", "--max-running-requests", "--chunked-prefill-size",
        "--max-prefill-tokens", "--api-key", "--admin-api-key", "--served-model-name",
        "--log-level")),
)  # fmt: skip

LIGHTLLM = (
    CompatFlag(Peer.LIGHTLLM, "--enable_cpu_cache",
               "L2 (host) on; without it (and with other LightLLM cache flags) L2 is off"),
    CompatFlag(Peer.LIGHTLLM, "--cpu_cache_storage_size",
               "--host-cache-gb (GiB, as LightLLM counts; its default 2)", value=float),
    CompatFlag(Peer.LIGHTLLM, "--cpu_cache_token_page_size",
               "--page-size: here every tier shares one page size (LightLLM's default 256 with "
               "--enable_cpu_cache)", value=int),
    CompatFlag(Peer.LIGHTLLM, "--enable_disk_cache",
               "L3 (disk) on; without it (and with other LightLLM cache flags) "
               "--no-disk-cache"),
    CompatFlag(Peer.LIGHTLLM, "--disk_cache_storage_size",
               "--disk-cache-gb (GiB, as LightLLM counts; its default 10)", value=float),
    CompatFlag(Peer.LIGHTLLM, "--disk_cache_dir",
               "--disk-cache-dir (unset: ours, kept across restarts, where LightLLM takes a "
               "temporary folder)", value=str),
    CompatFlag(Peer.LIGHTLLM, "ENV:LIGHTLLM_DISK_CACHE_PROMPT_LIMIT_LENGTH",
               "--disk-admit-tokens (prompts shorter than this stay out of L3)", value=int),
    CompatFlag(Peer.LIGHTLLM, "--model_dir", "--model", value=str),
    CompatFlag(Peer.LIGHTLLM, "--max_total_token_num", "--device-cache-tokens (L1 in tokens)",
               value=int),
    CompatFlag(Peer.LIGHTLLM, "--running_max_req_size", "--max-running-requests", value=int),
    CompatFlag(Peer.LIGHTLLM, "--chunked_prefill_size", "--chunked-prefill-size", value=int),
    CompatFlag(Peer.LIGHTLLM, "--batch_max_tokens", "--max-prefill-tokens", value=int),
    CompatFlag(Peer.LIGHTLLM, "--disable_dynamic_prompt_cache", "--no-prefix-cache"),
    CompatFlag(Peer.LIGHTLLM, "--data_type", "--dtype (fp16/bf16/fp32 spelled out)", value=str,
               accepts=("fp16", "float16", "bf16", "bfloat16", "fp32", "float32")),
    CompatFlag(Peer.LIGHTLLM, "--tp", "1 only: " + _NO_PARALLEL, value=int, accepts=("1",)),
    CompatFlag(Peer.LIGHTLLM, "--mem_fraction",
               "L1 is not sized from a share of device memory here; " + _L1_SIZE + " (LightLLM: "
               "--max_total_token_num N)", Kind.REFUSED, value=float),
    CompatFlag(Peer.LIGHTLLM, "--graph_max_batch_size", "no CUDA graphs here", Kind.IGNORED,
               value=int),
    CompatFlag(Peer.LIGHTLLM, "--enable_fa3", "no FlashAttention-3 here (torch attention)",
               Kind.IGNORED),
    *(CompatFlag(Peer.LIGHTLLM, flag, "the same flag", Kind.SAME) for flag in ("--host", "--port")),
)  # fmt: skip

SEED = (
    CompatFlag(Peer.SEED, "--use_hiradix_cache",
               "the whole hierarchy on: L2 and L3 (an error with --no-host-cache, "
               "--no-disk-cache or --no-prefix-cache)"),
    CompatFlag(Peer.SEED, "--hiradix_cache_token_num",
               "L2 capacity in tokens (rounded up to whole pages), instead of --host-cache-gb",
               value=int),
    CompatFlag(Peer.SEED, "--hiradix_cache_gpu",
               "the PR kept its second tier on the GPU, carved out of L1 (L1 = "
               "max_total_token_num - hiradix_cache_token_num); here L2 is host shared memory "
               "that the cache service reads and writes, so it cannot live on the GPU: give L1 "
               "more with --device-cache-tokens and size L2 with --hiradix_cache_token_num",
               Kind.REFUSED),
)  # fmt: skip

COMPAT_FLAGS: tuple[CompatFlag, ...] = (*SGLANG, *LIGHTLLM, *SEED)
GROUP_TITLES = {
    Peer.SGLANG: "compatibility: SGLang HiCache",
    Peer.LIGHTLLM: "compatibility: LightLLM multi-level cache",
    Peer.SEED: "compatibility: the seed's LightLLM hiradix flags",
}


def add_compat_flags(parser: argparse.ArgumentParser) -> None:
    """One argument group per peer, each flag's help saying what it becomes here."""
    seen: set[str] = set()
    for peer, title in GROUP_TITLES.items():
        g = parser.add_argument_group(title, f"{peer}'s flags, with their meanings "
                                      "(docs/migrating.md)")  # fmt: skip
        for row in COMPAT_FLAGS:
            if row.peer is not peer or not row.registered or row.dest in seen:
                continue
            seen.add(row.dest)  # --tp is both SGLang's and LightLLM's: one flag
            text = row.ours.replace("%", "%%")
            if row.kind is not Kind.MAPPED:
                text = f"{row.kind.value}: {text}"
            if row.value is None:
                g.add_argument(row.flag, dest=row.dest, action="store_const", const=True,
                               default=None, help=text)  # fmt: skip
            else:
                kind = finite_float if row.value is float else row.value  # nan/inf: refused
                g.add_argument(row.flag, dest=row.dest, type=kind, default=None,
                               metavar=row.value.__name__.upper(), help=text)  # fmt: skip
