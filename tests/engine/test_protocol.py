import msgpack
import pytest

from asynchicache.engine.protocol import (
    AbortRequest,
    AdminReply,
    AdminRequest,
    CachedTokens,
    GenerateRequest,
    SamplingParams,
    StepOutputs,
    TokenOutput,
    decode,
    encode,
)


@pytest.mark.parametrize(
    "msg",
    [
        GenerateRequest("r1", (1, 2, 3), SamplingParams(max_tokens=4, stop=("\n",)), "salt"),
        AbortRequest("r2"),
        AdminRequest("a1", "lookup", (1, 2), "t"),
        AdminRequest("a2", "clear", (), "t", ("device", "disk"), True),
        AdminRequest("a3", "pin", (1, 2), "", ttl_s=30.5),
        AdminRequest("a4", "unpin", pin_ids=("ab" * 16,)),
        GenerateRequest("r4", (1,), SamplingParams(max_tokens=1), cache_store=False),
        AdminReply("a1", True, {"device": 16, "nested": {"x": [1, 2]}}),
        TokenOutput("r3", (5,), True, "stop", 3, 1, CachedTokens(16, 32, 48, 0)),
        StepOutputs((TokenOutput("r4", (7,)), TokenOutput("r5", (8, 9), True, "length"))),
    ],
)
def test_round_trip(msg: object) -> None:
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "data", [b"", b"\xc1", b"\x93\x01\x02\x03", msgpack.packb({"__t": "Nope"})]
)
def test_garbage_is_a_clean_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode(data)


def test_sampling_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_a_step_of_outputs_with_one_mistyped_output_is_refused() -> None:
    bad = encode(StepOutputs((TokenOutput("r4", (7,)), TokenOutput("r5", ("x",)))))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mistyped"):
        decode(bad)


def test_cached_tokens_less_takes_the_deepest_tiers_first() -> None:
    cached = CachedTokens(device=32, host=16, disk=1, remote=0)
    assert cached.less(1) == CachedTokens(32, 16, 0, 0)
    assert cached.less(17) == CachedTokens(32, 0, 0, 0)
    assert cached.less(100) == CachedTokens()


def test_encode_refuses_what_is_not_an_engine_message() -> None:
    with pytest.raises(TypeError):
        encode({"__t": "AbortRequest", "rid": "r"})


def test_an_int_in_a_float_field_decodes_as_a_float() -> None:
    back = decode(encode(SamplingParams(temperature=0)))  # type: ignore[arg-type]
    assert back.temperature == 0.0 and type(back.temperature) is float
