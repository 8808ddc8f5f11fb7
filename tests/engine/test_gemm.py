"""Linear layers through oneDNN with reordered weights: the same products, and torch's
kernels wherever packing does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asynchicache.model import gemm
from asynchicache.model.llama import Linear
from asynchicache.model.loader import LoadedModel, load_model

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(),
    reason="this torch build has no oneDNN (packing falls back)",
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 8, 33, 300])
def test_packed_linear_computes_the_same_product(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    packed = gemm.pack(weight)
    assert packed is not None
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(gemm.linear(x, weight, packed, bias), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(gemm.linear(x, weight, None, bias), expected)  # unpacked: torch's


def test_what_cannot_be_packed_runs_on_torch_kernels() -> None:
    assert gemm.pack(torch.zeros(4, 4, dtype=torch.float16)) is None
    layer = Linear(4, 3, bias=False)
    layer.weight.data = torch.arange(12, dtype=torch.float16).view(3, 4)
    assert not layer.prepack() and layer.packed is None
    x = torch.ones(2, 4, dtype=torch.float16)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


@needs_onednn
def test_a_loaded_model_is_packed(tiny_llama: LoadedModel, tiny_checkpoints: dict) -> None:
    model = tiny_llama.model
    assert model.output_packed is not None
    assert all(m.packed is not None for m in model.modules() if isinstance(m, Linear))
    half = load_model(tiny_checkpoints["llama3-rope-tied"], dtype="float16")
    assert half.model.output_packed is None  # float16: torch's kernels everywhere
    assert not any(m.packed is not None for m in half.model.modules() if isinstance(m, Linear))
