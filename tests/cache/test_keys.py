import random
import subprocess
import sys

import pytest

from asynchicache.common.keys import (
    ENGINE,
    KV_LAYOUT_VERSION,
    NUMERICS_VERSION,
    Namespace,
    chain_hashes,
    namespace_digest,
    page_hashes,
)

NS = Namespace("smollm2-test", "float32", 16)

SCRIPT = """
import json, random, sys
from asynchicache.common.keys import Namespace, page_hashes
rng = random.Random(7)
tokens = [rng.randrange(50000) for _ in range(1000)]
ns = Namespace("smollm2-test", "float32", 16, cache_salt=sys.argv[1])
print(json.dumps([h.hex() for h in page_hashes(ns, tokens)]))
"""


def _hashes_in_subprocess(salt: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, salt], capture_output=True, text=True, check=True
    )
    import json

    return json.loads(out.stdout)


def test_chain_is_identical_in_two_processes() -> None:
    first = _hashes_in_subprocess("")
    second = _hashes_in_subprocess("")
    rng = random.Random(7)
    tokens = [rng.randrange(50000) for _ in range(1000)]
    here = [h.hex() for h in page_hashes(NS, tokens)]
    assert first == second == here
    assert len(first) == 1000 // 16


def test_salt_and_namespace_fields_change_every_hash() -> None:
    tokens = list(range(64))
    base = page_hashes(NS, tokens)
    others = [
        Namespace("smollm2-test", "float32", 16, cache_salt="tenant-b"),
        Namespace("other-model", "float32", 16),
        Namespace("smollm2-test", "bfloat16", 16),
        Namespace("smollm2-test", "float32", 16, layout_version=KV_LAYOUT_VERSION + 1),
        Namespace("smollm2-test", "float32", 16, engine="vllm"),
        Namespace("smollm2-test", "float32", 16, numerics_version=NUMERICS_VERSION + 1),
    ]
    for ns in others:
        assert not set(page_hashes(ns, tokens)) & set(base)
    assert page_hashes(Namespace("smollm2-test", "float32", 32), tokens) != base[:2]


def test_hash_depends_on_whole_prefix() -> None:
    a = page_hashes(NS, list(range(48)))
    b = page_hashes(NS, [999, *list(range(1, 48))])
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_incremental_chain_matches_full_chain() -> None:
    tokens = list(range(200))
    full = page_hashes(NS, tokens)
    tail = chain_hashes(full[4], tokens, 16, start_page=5)
    assert full[5:] == tail
    assert len(full) == 12  # the partial last page has no hash


def test_bad_namespace_rejected() -> None:
    with pytest.raises(ValueError, match="page_size"):
        Namespace("m", "float32", 0)


def test_namespace_names_our_engine_and_its_numerics() -> None:
    assert NS.engine == ENGINE == "asynchicache"
    assert NS.numerics_version == NUMERICS_VERSION
    fields = NS.encode().split(b"\x1f")
    assert fields[-2:] == [ENGINE.encode(), str(NUMERICS_VERSION).encode()]
    with pytest.raises(ValueError, match="engine"):
        Namespace("m", "float32", 16, engine="")


def test_namespace_decodes_what_it_encodes() -> None:
    salted = Namespace("fp", "bfloat16", 32, cache_salt="t", engine="vllm", numerics_version=7)
    for ns in (NS, salted):
        assert Namespace.decode(ns.encode()) == ns
        assert namespace_digest(ns.encode()) == ns.digest()
    assert NS.with_salt("t").with_salt("") == NS
    for bad in (b"", b"a\x1fb", b"\xff\xfe", b"fp\x1ff\x1fx\x1f1\x1f\x1fe\x1f1"):
        with pytest.raises(ValueError, match="namespace"):
            Namespace.decode(bad)
