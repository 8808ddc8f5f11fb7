"""The L2 pool as a storage backend receives it: checked before any page is read or written."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check_pool(pool: np.ndarray, page_bytes: int, slots: Sequence[int]) -> None:
    """`pool` must be the L2 pool as `[slots, page_bytes]` uint8 and every slot in range."""
    if pool.dtype != np.uint8 or pool.ndim != 2 or pool.shape[1] != page_bytes:
        raise ValueError(f"pool must be uint8 [slots, {page_bytes}], got {pool.dtype} {pool.shape}")
    if not pool.flags.c_contiguous:
        raise ValueError("pool must be C-contiguous")
    bad = [s for s in slots if not 0 <= s < pool.shape[0]]
    if bad:
        raise ValueError(f"slots out of range [0, {pool.shape[0]}): {bad[:8]}")
