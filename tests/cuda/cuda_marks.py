"""The mark every test under tests/cuda carries: `cuda`, and skipped without a GPU.

scripts/gpu-check.sh runs them (`pytest -m cuda`) on a machine with one; elsewhere
they are collected and skipped with the reason, so they stay importable and linted.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA GPU here (torch.cuda.is_available() is False); scripts/gpu-check.sh "
        "runs these on a GPU machine",
    ),
]


def cuda_test_model() -> str | None:
    """The model the CUDA tests run: $ASYNCHICACHE_CUDA_MODEL (gpu-check.sh sets it to a
    random SmolLM2-shaped model: the embedded GGUF is too large to carry to a GPU
    machine), else None, the embedded SmolLM2."""
    return os.environ.get("ASYNCHICACHE_CUDA_MODEL") or None
