"""Matrix products of the linear layers on CPU: oneDNN with weights reordered once.

`F.linear` on CPU calls MKL's sgemm with the weight as stored. oneDNN with the
weight reordered ahead of time into its blocked layout (what vLLM's CPU
backend does, `onednn_mm`) was 1.5-2x faster at decode-sized batches here
(SmolLM2-135M shapes, float32, one thread, AMD EPYC with AVX-512: gate/up at
8 rows 0.73 -> 0.38 ms, the 49,152-row LM head 20 -> 10.6 ms; at 256 rows
about 1.2x). Reordering needs no new weights: `pack` runs after loading.

Numerics: the sums are ordered differently from sgemm (differences near 1e-6
relative, below the 1e-5 of tests/engine/test_numerics.py, like a change of
thread count), and `NUMERICS_VERSION` (common/keys.py) was bumped for it all the
same: pages cached by the sgemm code are misses, never mixed with these.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# The batch size oneDNN's reorder optimizes for (vLLM's choice; 1 was slower).
PACK_ROWS = 32
_PACKABLE = (torch.float32, torch.bfloat16)


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] reordered for oneDNN, or None where that does not apply
    (not on CPU, no oneDNN in this torch build, a dtype it does not speed up)."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
    except (RuntimeError, AttributeError) as exc:  # a build without the op
        log.warning("oneDNN weight packing unavailable (%s); using torch's linear", exc)
        return None


def linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., in] -> [..., out] = x weight^T (+ bias), through `packed` when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
