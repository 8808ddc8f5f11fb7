"""The mark every test under tests/cuda carries: `cuda`, and skipped without a GPU.

scripts/gpu-check.sh runs them (`pytest -m cuda`) on a machine with one; elsewhere
they are collected and skipped with the reason, so they stay importable and linted.
"""

from __future__ import annotations

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
