"""Fuzzing of everything that decodes bytes from another process or from a file:

* the cache service's message decoder (`storage/messages.py`),
* the engine protocol decoder (`engine/protocol.py`),
* the page header parser (`storage/header.py`).

Inputs are random bytes, valid encodings with bytes flipped, cut or appended,
and well-formed msgpack of the wrong shapes. The only acceptable failure is a
clean ValueError (HeaderError is one); a message that decodes must be typed
as its dataclass says, so nothing half-built reaches the engine or the service.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from typing import Any

import msgpack
import pytest
from fuzz_settings import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from asynchicache.engine import protocol
from asynchicache.storage import messages
from asynchicache.storage.base import PageLayout, PageRef
from asynchicache.storage.header import (
    PageHeader,
    decode_header,
    encode_header,
    payload_checksum,
    peek_header_len,
)

# FUZZ_EXAMPLES=5000 for a longer run (scripts/faults-full.sh sets it).
FUZZ = fuzz_settings("FUZZ_EXAMPLES", 150)

H16 = bytes(range(16))
LAYOUT = PageLayout("float32", (2, 2, 4, 2, 8))

STORAGE_SAMPLES = [
    messages.Register(1, b"ns", "asynchicache-1-l2-ab", LAYOUT),
    messages.Load(2, (H16, H16), (0, 1), 500),
    messages.Store(3, (PageRef(H16, (1, 2, 3, 4), 4),)),
    messages.LoadReply(2, 1, 2, "short", 0),
    messages.StatsReply(5, None, {"requests": 3.0}),
    messages.ErrorReply(0, "malformed", "x"),
]
ENGINE_SAMPLES = [
    protocol.GenerateRequest(
        "r1", (1, 2, 3), protocol.SamplingParams(4, 0.0, 1.0, 0, 7, (2,), ("\n",)), "salt"
    ),
    protocol.AbortRequest("r1"),
    protocol.TokenOutput("r1", (5,), True, "stop", 3, 1, protocol.CachedTokens(1, 2, 3, 4)),
    protocol.AdminRequest("a1", "lookup", (1, 2), "salt"),
    protocol.AdminReply("a1", True, {"x": 1}),
]
HEADER = PageHeader(b"model\x1ffloat32\x1f4", H16, (1, 2, 3, 4), LAYOUT, 512, b"c" * 16)


def mutations(samples: list[bytes]) -> st.SearchStrategy[bytes]:
    """Valid encodings with bytes flipped, a tail cut off, or junk spliced in."""

    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(draw(st.sampled_from(samples)))
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(("flip", "cut", "splice")))
            pos = draw(st.integers(0, max(0, len(data) - 1)))
            if op == "flip" and data:
                data[pos] ^= draw(st.integers(1, 255))
            elif op == "cut":
                del data[pos:]
            else:
                data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        return bytes(data)

    return mutate()


# Well-formed msgpack of wrong shapes: every known type name with fields of any type.
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=20),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def typed_garbage(type_names: list[str], fields: list[str]) -> st.SearchStrategy[bytes]:
    """msgpack maps tagged with a known type name whose fields (real names) hold anything,
    including other tagged maps."""
    tagged = st.recursive(
        _VALUES,
        lambda inner: st.builds(
            lambda t, body: {"__t": t, **body},
            st.sampled_from(type_names),
            st.dictionaries(st.sampled_from(fields), inner, max_size=6),
        ),
        max_leaves=10,
    )
    body = st.dictionaries(st.sampled_from(fields), tagged, max_size=8)
    return st.builds(
        lambda t, b: msgpack.packb({"__t": t, **b}, use_bin_type=True),
        st.sampled_from(type_names),
        body,
    )


def _field_names(classes: typing.Iterable[type]) -> list[str]:
    return sorted({f.name for cls in classes for f in dataclasses.fields(cls)})


# ---------------------------------------------------------------- type checking of results


def conforms(value: Any, hint: Any) -> bool:
    """Whether `value` has the type `hint` describes (the subset our messages use)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return isinstance(value, tuple) and all(conforms(v, item) for v in value)
    if origin is dict:
        k, v = typing.get_args(hint)
        return isinstance(value, dict) and all(
            conforms(a, k) and conforms(b, v) for a, b in value.items()
        )
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint) and well_typed(value)
    if hint is float:
        return isinstance(value, float | int) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def well_typed(msg: Any) -> bool:
    hints = typing.get_type_hints(type(msg))
    return all(conforms(getattr(msg, f.name), hints[f.name]) for f in dataclasses.fields(msg))


def _decode_cleanly(decode: typing.Callable[[bytes], Any], data: bytes) -> None:
    try:
        msg = decode(data)
    except ValueError:
        return
    assert dataclasses.is_dataclass(msg), msg
    assert well_typed(msg), f"decoded a mistyped message: {msg!r}"


# ---------------------------------------------------------------- messages (both codecs)


@pytest.mark.parametrize("msg", STORAGE_SAMPLES + ENGINE_SAMPLES, ids=lambda m: type(m).__name__)
def test_samples_round_trip(msg: Any) -> None:
    codec = messages if type(msg).__name__ in messages.MESSAGE_TYPES else protocol
    assert codec.decode(codec.encode(msg)) == msg
    assert well_typed(msg)


STORAGE_NAMES = [*messages.MESSAGE_TYPES, "PageLayout", "PageRef", "BackendStats"]

# Each codec's decoder, and the frames it is fuzzed with: random bytes, its samples
# mutated, and maps tagged with its own type names whose (real) fields hold anything.
DECODERS = {"storage": messages.decode, "engine": protocol.decode}
FRAMES = {
    "storage": {
        "random": st.binary(max_size=512),
        "mutated": mutations([messages.encode(m) for m in STORAGE_SAMPLES]),
        "wrong_shapes": typed_garbage(
            STORAGE_NAMES, _field_names([*messages.MESSAGE_TYPES.values(), PageLayout, PageRef])
        ),
    },
    "engine": {
        "random": st.binary(max_size=512),
        "mutated": mutations([protocol.encode(m) for m in ENGINE_SAMPLES]),
        "wrong_shapes": typed_garbage(
            list(protocol.MESSAGE_TYPES), _field_names(protocol.MESSAGE_TYPES.values())
        ),
    },
}


@pytest.mark.parametrize(("codec", "frames"), [(c, f) for c in FRAMES for f in FRAMES[c]])
@FUZZ
@given(data=st.data())
def test_decoder_fails_cleanly(codec: str, frames: str, data: st.DataObject) -> None:
    _decode_cleanly(DECODERS[codec], data.draw(FRAMES[codec][frames]))


def test_deep_nesting_is_a_clean_error() -> None:
    deep = b"\x91" * 100_000 + b"\xc0"  # a list in a list in ... (msgpack fixarray of 1)
    for decode in (messages.decode, protocol.decode):
        with pytest.raises(ValueError):
            decode(deep)


# ---------------------------------------------------------------- page headers


def _header_bytes(header: PageHeader) -> bytes:
    return encode_header(header)


@FUZZ
@given(st.binary(max_size=8192))
def test_header_parser_random_bytes(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        peek_header_len(data)
    with contextlib.suppress(ValueError):
        decode_header(data)


@FUZZ
@given(mutations([_header_bytes(HEADER)]))
def test_header_parser_mutated(data: bytes) -> None:
    """Any change to a header is caught (the padding included), never misread."""
    try:
        header = decode_header(data)
    except ValueError:
        return
    assert header == HEADER  # only a change beyond header_len may pass (it is not the header)
    assert len(data) >= HEADER.header_len and data[: HEADER.header_len] == _header_bytes(HEADER)


@FUZZ
@given(
    st.binary(min_size=0, max_size=64),
    st.binary(min_size=16, max_size=16),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=64),
    st.sampled_from(["float32", "bfloat16", "float16"]),
    st.lists(st.integers(1, 64), min_size=1, max_size=6),
)
def test_header_round_trip(
    ns: bytes, page_hash: bytes, tokens: list[int], dtype: str, shape: list[int]
) -> None:
    layout = PageLayout(dtype, tuple(shape))
    header = PageHeader(
        ns, page_hash, tuple(tokens), layout, layout.page_bytes, payload_checksum(b"x")
    )
    assert decode_header(encode_header(header)) == header
