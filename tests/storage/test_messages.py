"""Storage messages: every type round-trips; anything malformed is a clean ValueError."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asynchicache.common.tiers import AllBlocksCleared, BlockRemoved, BlockStored
from asynchicache.storage.admin_messages import (
    Clear,
    ClearedPages,
    ClearReply,
    Contents,
    ContentsReply,
    Pin,
    PinChain,
    PinReply,
    Pins,
    PinsReply,
    StorageEvents,
    Unpin,
    UnpinReply,
)
from asynchicache.storage.base import BackendStats, PageLayout, PageRef
from asynchicache.storage.messages import (
    MESSAGE_TYPES,
    Cancel,
    CancelReply,
    ErrorReply,
    Exists,
    ExistsReply,
    Lease,
    LeaseReply,
    Load,
    LoadReply,
    Register,
    RegisterReply,
    Release,
    ServiceSettings,
    Stats,
    StatsReply,
    Store,
    StoreReply,
    decode,
    encode,
)

H = [bytes([i]) * 16 for i in range(3)]
SETTINGS = ServiceSettings("/var/kv", 20 << 30)
REMOTE = ServiceSettings("/var/kv", 1 << 30, "redis://127.0.0.1:6379/0", 600, 2, 512)
PIN = Pin(H[2].hex(), H[0], tuple(H), 8192, "tenant-a", 1_700_000_000.5, 1_700_003_600.5)
SAMPLES = [
    Register(1, b"model\x1ffloat32", "asynchicache-1-pool-ab", PageLayout("bfloat16", (2, 2, 4))),
    RegisterReply(1, 64),
    RegisterReply(1, 0, "segment not found"),
    RegisterReply(1, 64, None, 4242),
    Exists(2, tuple(H)),
    ExistsReply(2, 3),
    Load(3, tuple(H), (5, 6, 7), 250),
    Load(3, tuple(H), (5, 6, 7), 12_345_678_901_234_567),  # an absolute monotonic_ns
    Load(3, tuple(H), (5, 6, 7)),
    LoadReply(3, 2, 3, "payload checksum mismatch"),
    Store(4, (PageRef(H[0], (1, 2, 3), 9), PageRef(H[1], (), 10))),
    Store(4, (PageRef(H[0], (1,), 9, H[2]),), 12_345_678_901_234_567),
    StoreReply(4, 2, 2),
    Cancel(5, 3),
    CancelReply(5, 3, True),
    CancelReply(5, 3, False),
    Stats(6),
    StatsReply(6, BackendStats(pages=3, hits=2, extra={"vanished": 1.0}), {"requests": 7.0}),
    StatsReply(6),
    Clear(7),
    Clear(7, ("remote",), H[0], include_pinned=True),
    ClearReply(7, 12),
    ClearReply(
        7, 12, (ClearedPages("disk", 10, 2), ClearedPages("remote", 2, 0, "remote tier down"))
    ),
    PinChain(9, tuple(H), H[0], "tenant-a", 3600.0),
    PinChain(9, (H[1],), H[0]),
    PinReply(9, PIN, 3, 3 * 8192, 1 << 20),
    PinReply(9, None, 0, 9 << 20, 1 << 20, "over_limit", "pinning 3 pages would pin ..."),
    Unpin(10, (H[2].hex(),)),
    UnpinReply(10, 1),
    Pins(11),
    PinsReply(11, (PIN, dataclasses.replace(PIN, expires_at=None)), 3, 3 * 8192, 1 << 20),
    Contents(12),
    Contents(12, ("disk",)),
    ContentsReply(12, 41, tuple(H), (H[0], b"", H[1]), (H[2],), True),
    StorageEvents(
        0,
        42,
        (
            BlockStored("disk", tuple(H), H[0], tuple(range(12))),
            BlockStored("remote", (H[1],)),
            BlockRemoved("disk", (H[2],)),
            AllBlocksCleared("remote"),
        ),
    ),
    Register(1, b"model", "seg", PageLayout("float32", (2, 2, 4)), events=True),
    RegisterReply(1, 64, None, 4242, events_seq=17),
    ErrorReply(8, "unregistered", "register first"),
    Lease(13, 4242, SETTINGS, 30.0),
    Lease(13, 4242, REMOTE, 1.5),
    Lease(13, 4242, None, 30.0),
    Release(14),
    LeaseReply(13, True, SETTINGS, (), 2, 999),
    LeaseReply(13, False, REMOTE, ("disk_cache_bytes", "remote_url"), 1, 999),
]


def test_every_type_has_a_sample() -> None:
    assert {type(m).__name__ for m in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    back = decode(encode(msg))
    assert back == msg and type(back) is type(msg)


SETTINGS_MAP = {"__t": "ServiceSettings", "disk_cache_dir": "/kv", "disk_cache_bytes": 1}


def test_settings_name_what_differs() -> None:
    assert SETTINGS.differences(SETTINGS) == ()
    assert SETTINGS.differences(REMOTE) == (
        "disk_cache_bytes",
        "remote_url",
        "remote_ttl",
        "remote_admit_hits",
        "remote_admit_tokens",
    )


@pytest.mark.parametrize(
    "plain",
    [
        {"__t": "Nope", "req_id": 1},
        {"__t": "Exists", "req_id": 1},  # missing field
        {"__t": "Exists", "req_id": "1", "hashes": []},  # wrong type
        {"__t": "Exists", "req_id": True, "hashes": []},  # bool is not an int
        {"__t": "Exists", "req_id": 1, "hashes": [b"short"]},  # not a 16-byte hash
        {"__t": "Load", "req_id": 1, "hashes": [b"x" * 16], "slots": []},  # lengths differ
        {"__t": "Store", "req_id": 1, "pages": [{"__t": "PageLayout"}]},  # wrong nested type
        {
            "__t": "Register",
            "req_id": 1,
            "namespace": b"n",
            "segment": "s",
            "layout": {"__t": "PageLayout", "dtype": "float99", "shape": [1]},
        },
        {"__t": "Clear", "req_id": 1, "tiers": ["tape"]},  # unknown tier
        {"__t": "Clear", "req_id": 1, "root": b"short"},  # not a hash
        {"__t": "PinChain", "req_id": 1, "pages": [], "root": b"r" * 16},  # empty chain
        {"__t": "PinChain", "req_id": 1, "pages": [b"p" * 16], "root": b"r" * 16, "ttl_s": -1},
        {"__t": "PinChain", "req_id": 1, "pages": [b"p" * 15], "root": b"r" * 16},
        {"__t": "StorageEvents", "req_id": 0, "seq": 1, "events": [{"__t": "Pin"}]},  # not one
        {"__t": "StorageEvents", "req_id": 0, "seq": 1, "events": [{"__t": "AllBlocksCleared"}]},
        {"__t": "Lease", "req_id": 1, "holder": 0, "settings": SETTINGS_MAP, "ttl_s": 30.0},
        {"__t": "Lease", "req_id": 1, "holder": 7, "settings": SETTINGS_MAP, "ttl_s": 0.0},
        {"__t": "Lease", "req_id": 1, "holder": 7, "settings": SETTINGS_MAP, "ttl_s": 1e9},
        {"__t": "Lease", "req_id": 1, "holder": 7, "settings": {"__t": "Stats"}, "ttl_s": 1.0},
        [1, 2, 3],
        None,
    ],
)
def test_malformed_is_a_value_error(plain: object) -> None:
    with pytest.raises(ValueError):
        decode(msgpack.packb(plain, use_bin_type=True))


@given(st.binary(max_size=300))
@settings(max_examples=150, deadline=None)
def test_random_bytes_only_raise_value_error(data: bytes) -> None:
    try:
        msg = decode(data)
    except ValueError:
        return
    assert encode(decode(encode(msg))) == encode(msg)  # bytes: NaN-proof


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=20),
    st.sampled_from([*MESSAGE_TYPES, "PageRef", "PageLayout", "BlockStored", "Pin"]),
)
_tree = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(
            st.sampled_from(["__t", "req_id", "hashes", "slots", "pages", "layout", "disk", "x"]),
            kids,
            max_size=5,
        ),
    ),
    max_leaves=20,
)


_FIELDS = sorted(
    {f.name for cls in MESSAGE_TYPES.values() for f in dataclasses.fields(cls)} | {"junk"}
)


@given(st.sampled_from(list(MESSAGE_TYPES)), st.dictionaries(st.sampled_from(_FIELDS), _tree))
@settings(max_examples=150, deadline=None)
def test_random_structures_only_raise_value_error(name: str, body: dict) -> None:
    try:
        msg = decode(msgpack.packb({**body, "__t": name}, use_bin_type=True))
    except ValueError:
        return
    assert encode(decode(encode(msg))) == encode(msg)  # bytes: NaN-proof


def test_encode_refuses_foreign_objects() -> None:
    with pytest.raises(TypeError):
        encode({"__t": "Stats", "req_id": 1})


def test_the_wire_format_is_a_tagged_map_in_field_order() -> None:
    """What the vLLM connector's service and older clients read: must not change."""
    msg = Load(7, (b"h" * 16,), (3,), 5)
    plain = {"__t": "Load", "req_id": 7, "hashes": [b"h" * 16], "slots": [3], "deadline_ns": 5}
    assert encode(msg) == msgpack.packb(plain, use_bin_type=True)
