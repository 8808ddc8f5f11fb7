"""`asynchicache cache verify --deep`: recompute what a disk folder holds and compare.

The folder comes from a real engine run (a tiny model, the real cache service
in a thread, real page files); each test audits its own copy.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import SamplingParams
from asynchicache.model.loader import load_model
from asynchicache.settings.config import CacheConfig, EngineConfig
from asynchicache.storage.client.storage_client import ClientConfig
from asynchicache.storage.disk.disk_admin import OLD_FORMAT, read_page_file
from asynchicache.storage.header import MAGIC, encode_header, payload_checksum
from asynchicache.storage.service.in_thread import client_in_thread
from asynchicache.storage.service.server import ServiceConfig
from asynchicache.tools.audit import AuditConfig, deep_verify

REPO = Path(__file__).resolve().parents[2]
MODEL = "llama3-rope-tied"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_folder(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A disk folder written by a real engine: three prompts, two sharing two pages."""
    root = tmp_path_factory.mktemp("audit") / "kv"
    sock = Path(tempfile.mkdtemp(prefix="acs-"))
    rng = random.Random(3)
    shared = [rng.randrange(1, 1024) for _ in range(32)]
    prompts = [
        shared + [rng.randrange(1, 1024) for _ in range(60)],
        shared + [rng.randrange(1, 1024) for _ in range(45)],
        [rng.randrange(1, 1024) for _ in range(70)],
    ]
    service = ServiceConfig(root, address=f"ipc://{sock}/svc.sock")
    client = client_in_thread(service, ClientConfig(service.address))
    loaded = load_model(tiny_checkpoints[MODEL])
    engine = Engine(EngineConfig(), CacheConfig(disk_cache_dir=root, host_cache_gb=0.05),
                    storage=client, loaded=loaded)  # fmt: skip
    try:
        engine.generate(prompts, GREEDY)
        engine.cache.drain()  # every L2 -> disk store has finished
    finally:
        engine.close()
        client.close()
        shutil.rmtree(sock, ignore_errors=True)
    yield root


@pytest.fixture
def folder(engine_folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "kv"
    shutil.copytree(engine_folder, copy)
    return copy


def _pages(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kv") if not p.name.startswith("."))


def _config(root: Path, tiny_checkpoints: dict[str, Path], **kw: object) -> AuditConfig:
    return AuditConfig(root, model=str(tiny_checkpoints[MODEL]), progress=False, **kw)  # type: ignore[arg-type]


def _cli(root: Path, model: Path, *extra: str) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "asynchicache", "cache", "verify", "--deep", "--disk-cache-dir",
         str(root), "--model", str(model), "--json", *extra],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.stdout.strip().startswith("{"), proc.stdout + proc.stderr
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def _swap_payload(target: Path, source: Path) -> None:
    """Give `target` the payload of `source` under a header whose checksum fits it."""
    header, _ = read_page_file(target, bytes.fromhex(target.stem), target.parent.parent.name)  # type: ignore[misc]
    _, payload = read_page_file(source, bytes.fromhex(source.stem), source.parent.parent.name)  # type: ignore[misc]
    forged = replace(header, payload_checksum=payload_checksum(payload))
    target.write_bytes(encode_header(forged) + bytes(payload))


def test_a_clean_folder_from_a_real_engine_run_verifies(
    folder: Path, tiny_checkpoints: dict[str, Path]
) -> None:
    pages = len(_pages(folder))
    assert pages >= 10  # 5 + 3 + 4 full pages, the shared two stored once
    code, report, stderr = _cli(folder, tiny_checkpoints[MODEL])
    assert code == 0, report
    assert "deep verify" in stderr and f"{pages}/{pages}" in stderr  # the progress bar
    assert report["checked"] == report["pages"] == pages
    assert report["mismatched"] == report["corrupt"] == report["unverifiable"] == 0
    assert 0 <= report["max_abs_diff"] <= report["tolerance"] == 1e-3
    assert len(_pages(folder)) == pages


def test_a_page_with_a_valid_checksum_but_another_pages_kv_is_caught(
    folder: Path, tiny_checkpoints: dict[str, Path]
) -> None:
    target, source = _pages(folder)[:2]
    _swap_payload(target, source)
    shallow = subprocess.run(
        [sys.executable, "-m", "asynchicache", "cache", "verify", "--disk-cache-dir", str(folder)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert shallow.returncode == 0, "the checksum alone cannot see it"
    code, report, _ = _cli(folder, tiny_checkpoints[MODEL])
    assert code == 1
    assert report["mismatched"] >= 1 and report["max_abs_diff"] > 1e-3
    assert any(str(target) in m for m in report["mismatched_files"])
    assert not target.exists(), "a wrong page is removed, as a reader removes a corrupt one"
    assert report["checked"] == report["pages"] and report["corrupt"] == 0


def test_corrupt_broken_chains_and_lying_headers_each_have_their_bucket(
    folder: Path, tiny_checkpoints: dict[str, Path]
) -> None:
    pages = _pages(folder)
    headers = {p: read_page_file(p, bytes.fromhex(p.stem), p.parent.parent.name)[0]  # type: ignore[index]
               for p in pages}  # fmt: skip
    by_hash = {h.page_hash: p for p, h in headers.items()}
    roots = [p for p, h in headers.items() if h.parent not in by_hash]
    children = {h.parent: p for p, h in headers.items()}
    # A first page gone: every page after it on its chain is unverifiable.
    lonely = next(r for r in roots if headers[r].page_hash in children)
    orphans = []
    cur = headers[lonely].page_hash
    while cur in children:
        orphans.append(children[cur])
        cur = headers[children[cur]].page_hash
    lonely.unlink()
    # A flipped payload byte: corrupt (the checksum sees it).
    flipped = next(p for p in pages if p != lonely and p not in orphans)
    data = bytearray(flipped.read_bytes())
    data[-5] ^= 0x40
    flipped.write_bytes(bytes(data))
    # A header whose tokens are not its name's (re-signed): mismatched, not "corrupt". A
    # first page, so that no damaged page above it makes it unverifiable instead (which
    # page comes first in `pages` follows the namespace's hash).
    liar = next(r for r in roots if r not in (lonely, flipped))
    header = headers[liar]
    payload = liar.read_bytes()[header.header_len :]
    liar.write_bytes(encode_header(replace(header, tokens=tuple(reversed(header.tokens))))
                     + payload)  # fmt: skip
    # A file of the format before parent hashes: a miss for today's code, not damage.
    source = next(p for p in pages if p not in (lonely, flipped, liar))  # still on disk
    old = bytearray(source.read_bytes())
    struct.pack_into("<H", old, len(MAGIC), 1)
    (source.parent / ("ab" * 16 + ".kv")).write_bytes(bytes(old))
    report = deep_verify(_config(folder, tiny_checkpoints, keep=True))
    assert report.unverifiable_reasons[OLD_FORMAT] == 1
    assert report.corrupt == 1 and flipped.name in report.corrupt_files[0]
    assert report.mismatched == 1 and liar.name in report.mismatched_files[0]
    assert report.unverifiable >= len(orphans) >= 1
    assert report.checked + report.corrupt + report.unverifiable == report.pages
    assert flipped.exists() and liar.exists(), "--keep removes nothing"


def test_sample_checks_at_most_n_pages(folder: Path, tiny_checkpoints: dict[str, Path]) -> None:
    report = deep_verify(_config(folder, tiny_checkpoints, sample=3))
    assert report.checked == 3 and report.skipped == report.pages - 3
    assert report.mismatched == 0


def test_pages_of_another_model_are_unverifiable_not_mismatched(
    folder: Path, tiny_checkpoints: dict[str, Path]
) -> None:
    other = AuditConfig(folder, model=str(tiny_checkpoints["qwen2"]), progress=False)
    report = deep_verify(other)
    assert report.checked == report.mismatched == 0
    assert report.unverifiable == report.pages > 0
    assert list(report.unverifiable_reasons) == [
        "another model, engine, numerics or KV layout than --model"
    ]


def test_deep_only_flags_need_deep(folder: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asynchicache", "cache", "verify", "--disk-cache-dir",
         str(folder), "--sample", "3"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode != 0 and "--sample" in proc.stderr and "--deep" in proc.stderr
