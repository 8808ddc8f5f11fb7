"""The engine's K/V arithmetic is versioned: cached pages never outlive the code that made them.

A fixed tiny model (weights from a seeded numpy generator, Hugging Face names,
so internal renames do not matter) prefills a fixed prompt in two chunks and
decodes two tokens through the real runner into a paged pool; the K/V it
writes must match `numerics_reference.json` within 1e-5 (exact bits vary with
the CPU and the thread count, so no bit checksum). When the arithmetic changes
on purpose, bump `NUMERICS_VERSION` in asynchicache/common/keys.py (the page
namespace, so every cached page of the old code becomes a miss) and rewrite
the reference:

    PYTHONPATH=. python tests/engine/test_numerics.py --write
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from asynchicache.common.keys import (
    NATIVE8_NUMERICS_VERSION,
    NATIVE_NUMERICS_VERSION,
    NUMERICS_VERSION,
)
from asynchicache.model import native
from asynchicache.model import row_ops as row_ops_module
from asynchicache.model.llama import LlamaForCausalLM
from asynchicache.model.model_config import ModelConfig, RopeConfig, RopeType
from asynchicache.model.registry import get_architecture
from asynchicache.model.runner import (
    ForwardBatch,
    ModelRunner,
    attention_kernel,
    numerics_version,
)

REFERENCE = Path(__file__).with_name("numerics_reference.json")
TOLERANCE = 1e-5
PAGE = 8
SEED = 20261201
# Every feature whose arithmetic feeds K/V: q/k norms, q/k/v biases, Llama 3 rotary
# scaling, grouped-query attention, and a second layer whose input went through attention.
CONFIG = ModelConfig(
    arch="Qwen3ForCausalLM",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope=RopeConfig(theta=10000.0, rope_type=RopeType.LLAMA3, factor=8.0,
                    original_max_position=16),
    max_position=128,
    qkv_bias=True,
    qk_norm=True,
)  # fmt: skip
PROMPT = [int(t) for t in np.random.RandomState(SEED + 1).randint(1, 256, size=22)]
DECODE = [17, 203]  # fed one at a time after the prompt (teacher forcing)


def hf_tensors(config: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights under Hugging Face names; norms near one, the rest small."""
    rng = np.random.RandomState(seed)  # the legacy generator: its stream never changes
    h, q, kv, mlp = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (config.head_dim,),
            p + "self_attn.k_norm.weight": (config.head_dim,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (mlp, h),
            p + "mlp.up_proj.weight": (mlp, h),
            p + "mlp.down_proj.weight": (h, mlp),
        }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (config.vocab_size, h)}
    for name, shape in shapes.items():
        noise = rng.standard_normal(shape).astype(np.float32) * 0.1
        yield name, torch.from_numpy(1.0 + noise if "norm" in name else noise)


def reference_kv(attention: str = "torch") -> np.ndarray:
    """[tokens, layers, 2, kv_heads, head_dim] float32: the K/V the engine writes, attending
    with torch or with a build of the native kernels (`attention`: kernel-ISA)."""
    with torch.device("cpu"):
        model: LlamaForCausalLM = get_architecture(CONFIG.arch).model_class(CONFIG)
    model.rotary.reset_buffers()
    model.load_hf_weights(hf_tensors(CONFIG, SEED))
    model.eval()
    n = len(PROMPT) + len(DECODE)
    pages = -(-n // PAGE)
    pool = torch.zeros(pages + 2, CONFIG.num_layers, 2, PAGE, CONFIG.num_kv_heads,
                       CONFIG.head_dim)  # fmt: skip
    table = list(range(pages + 1, 0, -1))[:pages]  # scattered, and page 0 left unused
    kernel = None
    if attention.startswith("kernel"):
        isa = attention.partition("-")[2] or None
        kernel = attention_kernel(CONFIG, torch.float32, torch.device("cpu"), use=True, isa=isa)
    runner = ModelRunner(model, pool, PAGE, kernel)
    split = 13  # a chunked prefill: the second chunk starts mid-page
    runner.forward(ForwardBatch([PROMPT[:split]], [0], [table]))
    runner.forward(ForwardBatch([PROMPT[split:]], [split], [table]))
    for i, token in enumerate(DECODE):
        runner.forward(ForwardBatch([[token]], [len(PROMPT) + i], [table]))
    # [pages, layers, 2, page, kv_heads, head_dim] -> [tokens, layers, 2, kv_heads, head_dim]
    kv = pool[table].permute(0, 3, 1, 2, 4, 5).reshape(-1, *pool.shape[1:3], *pool.shape[4:])
    return kv[:n].numpy().copy()


def drift(reference: dict, attention: str = "torch") -> float:
    """Largest absolute difference between today's K/V and the stored reference."""
    stored = np.asarray(reference["kv"], dtype=np.float32).reshape(reference["shape"])
    now = reference_kv(attention)
    assert now.shape == stored.shape, f"shape {now.shape} != reference {stored.shape}"
    return float(np.abs(now - stored).max())


def test_reference_kv_is_of_the_current_numerics_version() -> None:
    reference = json.loads(REFERENCE.read_text())
    assert reference["numerics_version"] == NUMERICS_VERSION, (
        f"NUMERICS_VERSION is {NUMERICS_VERSION} but {REFERENCE.name} holds version "
        f"{reference['numerics_version']}: rewrite it ({__doc__.split('    ')[-1].strip()})"
    )


def test_kv_numerics_match_the_reference_of_this_version() -> None:
    reference = json.loads(REFERENCE.read_text())
    worst = drift(reference)
    assert worst <= TOLERANCE, (
        f"the K/V of the reference model moved by {worst:.3g} (> {TOLERANCE}): pages cached by "
        f"the previous code would be served as hits. Bump NUMERICS_VERSION in "
        f"asynchicache/common/keys.py and rewrite {REFERENCE.name} (see this file's docstring)."
    )


@pytest.mark.parametrize("isa", native.runnable_isas())
def test_the_native_kernel_stays_within_float32_noise_of_torch(isa: str) -> None:
    """Its pages are another namespace (NATIVE_NUMERICS_VERSION: other last bits), but its
    K/V stay within the tolerance of torch's reference: every build this CPU runs (AVX2's
    too on an AVX-512 host)."""
    assert NATIVE_NUMERICS_VERSION != NUMERICS_VERSION
    assert drift(json.loads(REFERENCE.read_text()), f"kernel-{isa}") <= TOLERANCE


def test_each_lane_count_is_its_own_namespace() -> None:
    """The 8-lane build (AVX2) orders its sums otherwise than the 16-lane one: its pages are
    named apart, and an engine names its pages by the build it runs."""
    versions = {NUMERICS_VERSION, NATIVE_NUMERICS_VERSION, NATIVE8_NUMERICS_VERSION}
    assert len(versions) == 3
    for isa in native.runnable_isas():
        kernel = attention_kernel(CONFIG, torch.float32, torch.device("cpu"), use=True, isa=isa)
        expected = NATIVE8_NUMERICS_VERSION if isa == "avx2" else NATIVE_NUMERICS_VERSION
        assert numerics_version(kernel) == expected


def test_a_numerics_change_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check has teeth: GPT-J-style (interleaved) rotary instead of rotate-half moves K."""

    def interleaved_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2].clone(), x[..., 1::2].clone()
        x[..., 0::2] = even * cos - odd * sin
        x[..., 1::2] = odd * cos + even * sin
        return x

    monkeypatch.setattr(row_ops_module, "apply_rotary_", interleaved_rotary_)
    assert drift(json.loads(REFERENCE.read_text())) > TOLERANCE


def _write() -> None:
    kv = reference_kv()
    payload = {
        "numerics_version": NUMERICS_VERSION,
        "note": "written by tests/engine/test_numerics.py --write; see its docstring",
        "shape": list(kv.shape),
        "kv": [float(f"{v:.8g}") for v in kv.reshape(-1)],
    }
    REFERENCE.write_text(json.dumps(payload) + "\n")
    print(f"wrote {REFERENCE} ({kv.size} values, numerics version {NUMERICS_VERSION})")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(f"usage: PYTHONPATH=. python {sys.argv[0]} --write")
    _write()
