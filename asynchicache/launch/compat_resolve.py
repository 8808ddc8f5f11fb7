"""Parsed compatibility flags (launch/compat_flags.py) -> the values of our own flags.

Each peer's rules, as their docs and code define them:
* SGLang: any `--hicache-*` flag or `--enable-hierarchical-cache` turns L2 on and
  brings SGLang's defaults for what is not given (ratio 2.0, write_through, the
  `timeout` prefetch policy of 1 s + 0.25 s per 1,024 tokens); L3 exists only with
  `--hicache-storage-backend` (file: a folder; redis/valkey: L4, behind a folder);
* LightLLM: its cache flags bring its tiers: L2 only with `--enable_cpu_cache`, L3
  only with `--enable_disk_cache` (which needs L2), sizes in GiB, CPU pages of 256
  tokens by default;
* the seed: `--use_hiradix_cache` turns the whole hierarchy on.

A value our own flag was given explicitly and a peer's flag sets differently is an
error, as are two peers' cache flags in one launch line. Every refusal of a launch
line is reported at once, each with what to do instead.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from asynchicache.launch.compat_flags import COMPAT_FLAGS, CompatFlag, Kind, Peer
from asynchicache.settings.config import GIB

SGLANG_FILE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
SGLANG_FILE_DIR_DEFAULT = "/tmp/hicache"  # HiCacheFile's own default folder
SGLANG_RATIO = 2.0
SGLANG_TIMEOUT_BASE_S = 1.0
SGLANG_TIMEOUT_PER_KI_TOKEN_S = 0.25
LIGHTLLM_CPU_GB = 2.0
LIGHTLLM_DISK_GB = 10.0
LIGHTLLM_PAGE = 256
_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
_VALKEY_KEYS = ("host", "port", "db", "password")
_EXTRA_KEYS = ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys", "direct_io", "direct_io_alignment",
               *_VALKEY_KEYS)  # fmt: skip


class CompatError(ValueError):
    """One or more compatibility flags cannot hold here; the message lists each."""


@dataclass
class _Resolution:
    """What the rows given so far set (dest -> value, the flag that set it)."""

    given: dict[str, Any]  # row.flag -> parsed value (environment rows by "ENV:NAME")
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def get(self, flag: str) -> Any:
        return self.given.get(flag)

    def set(self, dest: str, value: Any, source: str) -> None:
        old = self.values.get(dest)
        if old is not None and old[0] != value:
            self.problems.append(f"{source} and {old[1]} disagree (both set what --"
                                 f"{dest.replace('_', '-')} sets)")  # fmt: skip
        self.values[dest] = (value, source)

    def refuse(self, message: str) -> None:
        self.problems.append(message)


def _given(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for row in COMPAT_FLAGS:
        if row.kind is Kind.SAME:
            continue
        value = environ.get(row.name) if row.is_env else getattr(args, row.dest, None)
        if value is not None:
            out[row.flag] = value
    return out


def _check_rows(r: _Resolution) -> None:
    """Refused and ignored rows, and values outside what a row accepts."""
    seen: set[str] = set()
    for row in COMPAT_FLAGS:
        value = r.get(row.flag)
        if value is None or row.flag in seen or row.is_env:
            continue
        seen.add(row.flag)
        if row.kind is Kind.REFUSED:
            r.refuse(f"{row.flag}: {row.ours}")
        elif row.kind is Kind.IGNORED:
            r.notes.append(f"{row.flag} ignored: {row.ours}")
        elif row.accepts and str(value) not in row.accepts:
            why = row.refuses.get(str(value)) or f"takes {', '.join(row.accepts)}: {row.ours}"
            r.refuse(f"{row.flag} {value}: {why}")


def _cache_flags(r: _Resolution, peer: Peer) -> list[str]:
    """The peer's cache flags given (they bring its tiers; --tp and the like do not)."""
    return [row.flag for row in COMPAT_FLAGS if row.peer is peer and not row.is_env
            and r.get(row.flag) is not None and _is_cache_flag(row)]  # fmt: skip


def _is_cache_flag(row: CompatFlag) -> bool:
    if row.peer is Peer.SGLANG:
        return row.flag.startswith("--hicache") or row.flag == "--enable-hierarchical-cache"
    return row.peer is Peer.LIGHTLLM and "_cache" in row.flag and "prompt" not in row.flag


def _extra_config(r: _Resolution, text: str | None) -> dict[str, Any]:
    flag = "--hicache-storage-backend-extra-config"
    if not text:
        return {}
    try:
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        extra = json.loads(text)
    except (OSError, ValueError) as exc:
        r.refuse(f"{flag}: not a JSON object ({exc})")
        return {}
    if not isinstance(extra, dict):
        r.refuse(f"{flag}: not a JSON object")
        return {}
    unknown = sorted(set(extra) - set(_EXTRA_KEYS))
    if unknown:
        r.refuse(f"{flag}: no counterpart here for {', '.join(unknown)} (known: "
                 f"{', '.join(_EXTRA_KEYS)})")  # fmt: skip
    return extra


def _number(r: _Resolution, extra: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = extra.get(key, default)
    number = not isinstance(value, bool) and isinstance(value, kind | int)
    if not number or not math.isfinite(value) or value < 0:  # JSON reads NaN and Infinity
        r.refuse(f"--hicache-storage-backend-extra-config: {key} must be a finite number >= 0, "
                 f"got {value!r}")  # fmt: skip
        return default
    return value


def _valkey_url(extra: dict[str, Any], environ: Mapping[str, str]) -> str:
    def pick(key: str, default: str) -> str:
        return str(extra.get(key, environ.get(f"VALKEY_{key.upper()}", default)))

    password = pick("password", "")
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{pick('host', 'localhost')}:{pick('port', '6379')}/{pick('db', '0')}"


def _sglang_storage(r: _Resolution, extra: dict[str, Any], environ: Mapping[str, str]) -> None:
    backend = r.get("--hicache-storage-backend")
    src = "--hicache-storage-backend"
    if backend is None:
        r.set("no_disk_cache", True, "--enable-hierarchical-cache without " + src)
    elif backend == "file":
        folder = environ.get(SGLANG_FILE_DIR_ENV, SGLANG_FILE_DIR_DEFAULT)
        r.set("no_disk_cache", False, src + " file")
        r.set("disk_cache_dir", Path(folder), f"{src} file (${SGLANG_FILE_DIR_ENV})")
    elif backend in ("redis", "valkey"):
        r.set("no_disk_cache", False, f"{src} {backend}")
        r.set("remote_url", _valkey_url(extra, environ), f"{src} {backend}")
    if backend not in ("redis", "valkey") and set(extra) & set(_VALKEY_KEYS):
        r.refuse(f"--hicache-storage-backend-extra-config: {', '.join(_VALKEY_KEYS)} go with "
                 "--hicache-storage-backend valkey or redis")  # fmt: skip
    if extra.get("direct_io") is False:
        r.refuse("--hicache-storage-backend-extra-config direct_io false: the disk tier uses "
                 "O_DIRECT whenever the page layout and L2 are aligned (buffered I/O otherwise) "
                 "and cannot turn it off; drop direct_io")  # fmt: skip


def _sglang(r: _Resolution, environ: Mapping[str, str]) -> None:
    for flag, dest in (("--model-path", "model"), ("--max-total-tokens", "device_cache_tokens")):
        if r.get(flag) is not None:
            r.set(dest, r.get(flag), flag)
    if r.get("--disable-radix-cache"):
        r.set("no_prefix_cache", True, "--disable-radix-cache")
    hicache = _cache_flags(r, Peer.SGLANG)
    if not hicache:
        return
    src = hicache[0]
    r.set("no_host_cache", False, src)
    extra = _extra_config(r, r.get("--hicache-storage-backend-extra-config"))
    _sglang_storage(r, extra, environ)
    size = r.get("--hicache-size") or 0
    if size < 0:
        r.refuse(f"--hicache-size {size}: must be >= 0 (0: --hicache-ratio decides)")
    elif size > 0:
        r.set("host_cache_gb", size * 1e9 / GIB, "--hicache-size")
    else:
        ratio = r.get("--hicache-ratio") or SGLANG_RATIO
        if ratio <= 0:
            r.refuse(f"--hicache-ratio {ratio}: must be positive")
        r.values["_hicache_ratio"] = (ratio, "--hicache-ratio")
    r.set("write_policy", r.get("--hicache-write-policy") or "write_through", src)
    r.set("prefetch_policy", r.get("--hicache-storage-prefetch-policy") or "timeout", src)
    base = _number(r, extra, "prefetch_timeout_base", float, SGLANG_TIMEOUT_BASE_S)
    per_ki = _number(r, extra, "prefetch_timeout_per_ki_token", float,
                     SGLANG_TIMEOUT_PER_KI_TOKEN_S)  # fmt: skip
    r.set("prefetch_timeout_s", float(base) or SGLANG_TIMEOUT_BASE_S, src)
    r.set("prefetch_timeout_per_ki_token_s", float(per_ki), src)
    if "prefetch_threshold" in extra:
        r.set("min_load_tokens", int(_number(r, extra, "prefetch_threshold", int, 0)),
              "prefetch_threshold")  # fmt: skip
    if not {"--hicache-ratio", "--hicache-size"} & set(hicache):
        r.notes.append(f"SGLang's --hicache-ratio {SGLANG_RATIO} sizes L2 (no size given)")


def _lightllm(r: _Resolution) -> None:
    simple = {"--model_dir": "model", "--max_total_token_num": "device_cache_tokens",
              "--running_max_req_size": "max_running_requests",
              "--chunked_prefill_size": "chunked_prefill_size",
              "--batch_max_tokens": "max_prefill_tokens"}  # fmt: skip
    for flag, dest in simple.items():
        if r.get(flag) is not None:
            r.set(dest, r.get(flag), flag)
    if r.get("--data_type") is not None:
        r.set("dtype", _DTYPES.get(r.get("--data_type"), r.get("--data_type")), "--data_type")
    if r.get("--disable_dynamic_prompt_cache"):
        r.set("no_prefix_cache", True, "--disable_dynamic_prompt_cache")
    cache = _cache_flags(r, Peer.LIGHTLLM)
    if not cache:
        return
    cpu, disk = bool(r.get("--enable_cpu_cache")), bool(r.get("--enable_disk_cache"))
    if disk and not cpu:
        r.refuse("--enable_disk_cache needs --enable_cpu_cache: L3 sits under L2, in LightLLM "
                 "as here")  # fmt: skip
    r.set("no_host_cache", not cpu, "--enable_cpu_cache" if cpu else cache[0])
    r.set("no_disk_cache", not disk, "--enable_disk_cache" if disk else cache[0])
    if cpu:
        r.set("host_cache_gb", r.get("--cpu_cache_storage_size") or LIGHTLLM_CPU_GB,
              "--cpu_cache_storage_size")  # fmt: skip
        r.set("page_size", r.get("--cpu_cache_token_page_size") or LIGHTLLM_PAGE,
              "--cpu_cache_token_page_size")  # fmt: skip
    if disk:
        r.set("disk_cache_gb", r.get("--disk_cache_storage_size") or LIGHTLLM_DISK_GB,
              "--disk_cache_storage_size")  # fmt: skip
        if r.get("--disk_cache_dir"):
            r.set("disk_cache_dir", Path(r.get("--disk_cache_dir")), "--disk_cache_dir")
        limit = r.get("ENV:LIGHTLLM_DISK_CACHE_PROMPT_LIMIT_LENGTH")
        if limit is not None:
            try:
                r.set("disk_admit_tokens", int(limit), "$LIGHTLLM_DISK_CACHE_PROMPT_LIMIT_LENGTH")
            except ValueError:
                r.refuse(f"$LIGHTLLM_DISK_CACHE_PROMPT_LIMIT_LENGTH={limit!r}: not a number")


def _seed(r: _Resolution, args: argparse.Namespace) -> None:
    if r.get("--use_hiradix_cache"):
        if args.no_prefix_cache:
            r.refuse("--use_hiradix_cache turns the hierarchy on; --no-prefix-cache turns "
                     "caching off")  # fmt: skip
        r.set("no_host_cache", False, "--use_hiradix_cache")
        r.set("no_disk_cache", False, "--use_hiradix_cache")
    if r.get("--hiradix_cache_token_num") is not None:
        r.set("host_cache_tokens", r.get("--hiradix_cache_token_num"), "--hiradix_cache_token_num")


def _finish(r: _Resolution, args: argparse.Namespace) -> None:
    """Values that depend on others: SGLang's ratio of L1."""
    ratio = r.values.pop("_hicache_ratio", None)
    if ratio is not None and not r.problems:
        l1 = r.values.get("device_cache_tokens", (args.device_cache_tokens, ""))[0]
        r.set("host_cache_tokens", int(l1 * ratio[0]), "--hicache-ratio")
    if "host_cache_gb" in r.values and "host_cache_tokens" in r.values:
        r.refuse(f"{r.values['host_cache_gb'][1]} and {r.values['host_cache_tokens'][1]} "
                 "both size L2; give one")  # fmt: skip


def resolve(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    """(our dest -> (value, the flag that set it), notes to log); CompatError lists refusals."""
    r = _Resolution(_given(args, environ))
    _check_rows(r)
    if _cache_flags(r, Peer.SGLANG) and _cache_flags(r, Peer.LIGHTLLM):
        r.refuse("SGLang's and LightLLM's flags in one launch line: translate one of them")
    _sglang(r, environ)
    _lightllm(r)
    _seed(r, args)
    _finish(r, args)
    if r.problems:
        raise CompatError("; ".join(r.problems))
    return r.values, r.notes


def apply_compat(
    args: argparse.Namespace, parser: argparse.ArgumentParser, environ: Mapping[str, str]
) -> tuple[argparse.Namespace, list[str]]:
    """A copy of `args` with the compatibility flags written into our flags' values."""
    values, notes = resolve(args, environ)
    out = argparse.Namespace(**vars(args))
    clashes = []
    if "host_cache_tokens" in values and args.host_cache_gb != parser.get_default("host_cache_gb"):
        clashes.append(
            f"{values['host_cache_tokens'][1]} and --host-cache-gb both size L2; give one"
        )
    for dest, (value, source) in values.items():
        ours = getattr(args, dest, None)
        if ours != parser.get_default(dest) and ours != value:
            clashes.append(f"{source} sets what --{dest.replace('_', '-')} {ours} sets; give one")
        setattr(out, dest, value)
    if clashes:
        raise CompatError("; ".join(clashes))
    return out, notes
