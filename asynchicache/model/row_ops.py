"""The row-wise steps of a decoder layer: RMSNorm, the residual add with the next RMSNorm,
SiLU(gate) * up, rotary embeddings, and the copy of new K/V rows into their pages.

`RowOps` does them with torch (any dtype, any device). `NativeRowOps` does them in the
native row kernels (`kernels/row_ops.c`: float32 on CPU), each row read once and written
once, rows shared by the attention kernel's threads; torch makes several whole-tensor
passes per step, and a long prompt's [tokens, intermediate] rows leave the caches between
them (for a 1,546-token prompt of SmolLM2 they were a tenth of the forward). The two give
other last bits, so the native ones come only with the native attention kernel (one
library, `native.py`), whose pages are their own namespace (NATIVE_NUMERICS_VERSION).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from asynchicache.model.native import KernelThreads
from asynchicache.model.rotary import apply_rotary_

# A part's least work when threads share a call (floats of its rows): below it the hand-off
# to another thread costs more than the part (a decode batch's rows stay on one thread).
MIN_PART_FLOATS = 1 << 15


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim]: normalized in float32 like the reference, scaled in x's dtype."""
    xf = x.float()
    # One reduction pass (vector_norm) instead of pow + mean: cheaper on CPU.
    norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)  # [..., 1]
    inv_rms = norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    return torch.mul(xf, inv_rms).to(x.dtype).mul_(weight)


class RowOps:
    """The steps with torch: any dtype and device (the reference arithmetic)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """[T, dim] -> a new [T, dim]."""
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta in place (the residual stream); returns its RMSNorm."""
        return self.rms_norm(residual.add_(delta), weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 n] (gate, then up) -> [T, n] silu(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [T, heads, head_dim] in place by cos/sin [T, 1, head_dim / 2]."""
        apply_rotary_(x, cos, sin)

    def scatter_(
        self, pool: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        """rows [T, kv_heads, hd] into a layer's view `pool` [pages, page_size, kv_heads,
        hd] at (pages[t], offsets[t]), in place (never `pool[idx] = ...` on a copy)."""
        pool.index_put_((pages, offsets), rows)


class NativeRowOps(RowOps):
    """The steps in the native row kernels where the tensors fit them (float32 on CPU,
    contiguous rows); torch's `RowOps` otherwise."""

    def __init__(self, threads: KernelThreads) -> None:
        self.threads = threads
        self.kernels = threads.kernel.rows

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or not _fits(x, weight):
            return super().rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rows(x, lambda r0, r1, t: self.kernels.rms_norm(x, weight, out, eps, r0, r1, t))
        return out

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        x = residual
        if x.dim() != 2 or x.shape != delta.shape or not _fits(x, delta, weight):
            return super().add_rms_norm(x, delta, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        k = self.kernels
        self._rows(x, lambda r0, r1, t: k.add_rms_norm(x, delta, weight, out, eps, r0, r1, t))
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not _fits(gate_up):
            return super().silu_mul(gate_up)
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        self._rows(gate_up, lambda r0, r1, t: self.kernels.silu_mul(gate_up, out, r0, r1, t))
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        cs, sn = cos[:, 0], sin[:, 0]  # [T, head_dim / 2]
        heads_contiguous = x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
        if not (heads_contiguous and _fits(cs, sn) and _fits(x[:, 0])):
            super().rotary_(x, cos, sin)
            return
        self._rows(x, lambda r0, r1, t: self.kernels.rotary(x, cs, sn, r0, r1, t))

    def scatter_(
        self, pool: torch.Tensor, rows: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        slot_contiguous = pool.stride(3) == 1 and pool.stride(2) == pool.shape[3]
        row_contiguous = rows.stride(2) == 1 and rows.stride(1) == rows.shape[2]
        if not (slot_contiguous and row_contiguous and _fits(pool, rows[:, 0])):
            super().scatter_(pool, rows, pages, offsets)
            return
        k = self.kernels
        self._rows(rows, lambda r0, r1, t: k.scatter_rows(pool, rows, pages, offsets, r0, r1, t))

    def _rows(self, x: torch.Tensor, call: Callable[[int, int, int], None]) -> None:
        """call(r0, r1, threads) over x's rows, shared by the kernel's threads when worth
        it: one call on an OpenMP team of `threads` (the kernel's team), else a call per
        Python thread over its part of the rows (threads 0)."""
        n = x.shape[0]
        parts = min(self.threads.parts(), x.numel() // MIN_PART_FLOATS, n)
        if self.threads.kernel.team and parts > 1:
            call(0, n, parts)
            return
        self.threads.share(lambda i, p: call(n * i // p, n * (i + 1) // p, 0), parts)


def _fits(*tensors: torch.Tensor) -> bool:
    """Float32 on CPU with contiguous rows (the kernels take a row stride only)."""
    return all(
        t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.stride(-1) == 1
        and (t.dim() > 1 or t.is_contiguous())
        for t in tensors
    )
