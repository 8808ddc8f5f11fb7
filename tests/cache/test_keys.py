import random
import subprocess
import sys

import pytest

from asynchicache.cache.keys import Namespace, chain_hashes, page_hashes

NS = Namespace("smollm2-test", "float32", 16)

SCRIPT = """
import json, random, sys
from asynchicache.cache.keys import Namespace, page_hashes
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
        Namespace("smollm2-test", "float32", 16, layout_version=2),
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
