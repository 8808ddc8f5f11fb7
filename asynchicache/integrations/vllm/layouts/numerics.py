"""What in vLLM's config changes the K/V numbers, read for the namespace.

Two vLLM instances whose configs differ in any of these compute different K/V
for the same tokens, so their pages must never meet (namespace.py):

* quantization: the method (`--quantization`, or the checkpoint's own config);
* dtype: the model's compute dtype;
* kv_cache_dtype: `--kv-cache-dtype` and the layers it skips (fp8 K/V scales
  come from the checkpoint's weights and config, both named already);
* hf_config: the model's HF config after `hf_overrides` (RoPE scaling, context
  extension, anything an override changes), and the overrides themselves;
* compilation: torch.compile's mode (fused kernels round differently);
* the attention backend vLLM actually selected for these layers (not the
  configured "auto") and, for CPU_ATTN, the kernel (ISA) it runs.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

# HF config keys that say where or with which library it was written, not what it computes.
_CONFIG_NOISE = frozenset({"_name_or_path", "transformers_version", "_commit_hash"})


def numerics_factors(vllm_config: VllmConfig) -> tuple[tuple[str, str], ...]:
    """The namespace's `numerics`: (factor, value) pairs, sorted."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    factors = {
        "quantization": str(model.quantization or "none"),
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cache.cache_dtype),
        "kv_cache_dtype_skip_layers": ",".join(sorted(map(str, cache.kv_cache_dtype_skip_layers))),
        "hf_config": config_digest(model.hf_config),
        "hf_overrides": overrides_text(model.hf_overrides),
        "compilation": str(vllm_config.compilation_config.mode),
    }
    return tuple(sorted(factors.items()))


def config_digest(hf_config: Any) -> str:
    """xxh3-128 of an HF config's values (after vLLM applied hf_overrides)."""
    data = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    data = {k: v for k, v in data.items() if k not in _CONFIG_NOISE}
    text = json.dumps(data, sort_keys=True, default=str)
    return xxhash.xxh3_128_hexdigest(text.encode())


def overrides_text(overrides: Any) -> str:
    """`hf_overrides` as text: a dict as sorted JSON, a function by its qualified name
    (its effect is in the HF config digest)."""
    if not overrides:
        return ""
    if callable(overrides):
        return f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}"
    return json.dumps(overrides, sort_keys=True, default=str)


def selected_backend(vllm_config: VllmConfig, head_size: int, num_heads: int) -> str:
    """The attention backend vLLM selects for a full-attention decoder layer of this
    model (the selector its layers call), with CPU_ATTN's kernel: e.g. `CPU_ATTN:vec`."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    model, cache = vllm_config.model_config, vllm_config.cache_config
    try:
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(
                head_size, model.dtype, cache.cache_dtype, num_heads=num_heads
            )
        return qualified_backend(vllm_config, backend.get_name())
    except Exception as exc:  # the workers' handshake then refuses every request
        log.warning("asynchicache: cannot tell which attention backend vLLM selects: %s", exc)
        return "unknown"


def qualified_backend(vllm_config: VllmConfig, name: str) -> str:
    """`name`, and for CPU_ATTN the kernel it picks (its numerics differ per ISA)."""
    if name != "CPU_ATTN":
        return name
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    model, cache = vllm_config.model_config, vllm_config.cache_config
    isa = _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    return f"{name}:{isa}"
