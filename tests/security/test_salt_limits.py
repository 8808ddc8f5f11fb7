"""Issue 39, finding 6: a cache_salt's length is bounded at the edge (a 400 naming the
field) and in the engine (an error output, an admin error), since each distinct salt has
a root in the radix tree and is part of every page name of its chains."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

import pytest
from engine_fixtures import l1_only_engine
from pydantic import ValidationError

from asynchicache.engine.engine import Engine
from asynchicache.engine.protocol import (
    MAX_CACHE_SALT_CHARS,
    AdminRequest,
    GenerateRequest,
    SamplingParams,
)
from asynchicache.model.loader import LoadedModel
from asynchicache.server.openai.schemas import ChatCompletionRequest, CompletionRequest

LONG = "s" * (MAX_CACHE_SALT_CHARS + 1)
OK = "s" * MAX_CACHE_SALT_CHARS


def test_the_edge_refuses_a_long_salt() -> None:
    CompletionRequest(model="m", prompt="hi", cache_salt=OK)
    with pytest.raises(ValidationError, match="cache_salt"):
        CompletionRequest(model="m", prompt="hi", cache_salt=LONG)
    with pytest.raises(ValidationError, match="cache_salt"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                              cache_salt=LONG)  # fmt: skip


@pytest.fixture
def engine(smollm: LoadedModel) -> Iterator[Engine]:
    with closing(l1_only_engine(smollm, 256)) as made:
        yield made


def test_the_engine_refuses_a_long_salt(engine: Engine) -> None:
    sampling = SamplingParams(max_tokens=1, temperature=0.0)
    out = engine.add_request(GenerateRequest("r", (1, 2, 3), sampling, cache_salt=LONG))
    assert out is not None and out.finish_reason == "error"
    assert out.error is not None and "cache_salt" in out.error
    assert len(engine.cache.tree.roots()) == 1
    reply = engine.admin(AdminRequest("a", "lookup", (1, 2, 3, 4), cache_salt=LONG))
    assert not reply.ok and "cache_salt" in (reply.error or "")
    assert engine.add_request(GenerateRequest("ok", (1, 2, 3), sampling, cache_salt=OK)) is None
