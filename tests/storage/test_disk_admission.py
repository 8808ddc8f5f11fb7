"""The one L2 -> L3 admission rule, as the engine and the service's promotions apply it."""

from __future__ import annotations

import pytest

from asynchicache.common.disk_admission import DiskAdmission
from asynchicache.storage.service.tiered import TieredConfig


@pytest.mark.parametrize(
    ("min_hits", "min_tokens", "hits", "tokens", "admitted"),
    [
        (0, 0, 0, 0, True),  # no limits: everything
        (2, 0, 1, 10_000, False),  # not hot enough; length does not count
        (2, 0, 2, 16, True),
        (0, 64, 9, 48, False),  # too short; hits do not count
        (0, 64, 0, 64, True),
        (3, 64, 3, 16, True),  # either limit admits
        (3, 64, 1, 80, True),
        (3, 64, 2, 63, False),
    ],
)
def test_hot_or_long_is_admitted(
    min_hits: int, min_tokens: int, hits: int, tokens: int, admitted: bool
) -> None:
    assert DiskAdmission(min_hits, min_tokens).admits(hits, tokens) is admitted


@pytest.mark.parametrize(("min_hits", "min_tokens"), [(0, 0), (1, 0), (2, 0), (0, 48), (2, 48)])
@pytest.mark.parametrize("pages", [1, 2, 3, 4])
def test_a_promotion_is_one_hit_of_the_chain_length(
    min_hits: int, min_tokens: int, pages: int
) -> None:
    tiered = TieredConfig(disk_admit_hits=min_hits, disk_admit_tokens=min_tokens, page_tokens=16)
    rule = DiskAdmission(min_hits, min_tokens)
    assert tiered.admits(pages) is rule.admits(hits=1, tokens=16 * pages)


def test_negative_limits_name_the_flags() -> None:
    with pytest.raises(ValueError, match="--disk-admit-hits"):
        DiskAdmission(-1, 0)
