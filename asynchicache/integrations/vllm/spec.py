"""What the connector needs from vLLM's config, read once and checked at start-up.

Both halves build a `VllmKVSpec` from the same `VllmConfig` and
`KVCacheConfig`, so they agree on the page layout without a handshake (a
page holds every tensor-parallel rank's heads, ranks.py). What we cannot
serve (hybrid or MLA models, encoder-decoder models, pipeline or context
parallelism, a block size our page size does not divide) is refused at start
with an error that says why, instead of caching wrong pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from asynchicache.common.keys import Namespace
from asynchicache.integrations.vllm.layouts.numerics import numerics_factors, selected_backend
from asynchicache.integrations.vllm.namespace import ModelIdentity, vllm_namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class VllmKVSpec:
    """One full-attention KV cache group, as vLLM allocates it."""

    block_size: int
    num_blocks: int
    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    identity: ModelIdentity
    max_model_len: int = 4096

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def tp_size(self) -> int:
        return self.identity.tp_size

    @property
    def page_kv_heads(self) -> int:
        """KV heads of one of our pages: every tensor-parallel rank's (ranks.py)."""
        return self.num_kv_heads * self.tp_size

    def namespace(self, page_size: int) -> Namespace:
        return vllm_namespace(self.identity, page_size)

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> VllmKVSpec:
        from vllm import __version__ as vllm_version
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

        refuse_parallelism(vllm_config)
        if vllm_config.model_config.is_encoder_decoder:
            raise ValueError(
                "AsynchicacheConnector does not cache encoder-decoder models (cross-attention)"
            )
        groups = kv_cache_config.kv_cache_groups
        spec = groups[0].kv_cache_spec if len(groups) == 1 else None
        if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
            kinds = [type(g.kv_cache_spec).__name__ for g in groups]
            raise ValueError(
                f"AsynchicacheConnector needs one full-attention KV cache group; got {kinds}"
            )
        if spec.head_size_v not in (None, spec.head_size):
            raise ValueError("AsynchicacheConnector needs K and V of one head size")
        model = vllm_config.model_config
        heads = model.get_num_attention_heads(vllm_config.parallel_config)
        identity = ModelIdentity(
            model=str(model.model),
            revision=model.revision,
            vllm_version=vllm_version,
            device=str(vllm_config.device_config.device_type),
            attention_backend=selected_backend(vllm_config, spec.head_size, heads),
            kv_dtype=str(spec.dtype).removeprefix("torch."),
            block_size=spec.block_size,
            numerics=numerics_factors(vllm_config),
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
        )
        return cls(
            block_size=spec.block_size,
            num_blocks=kv_cache_config.num_blocks,
            layer_names=tuple(groups[0].layer_names),
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_size,
            dtype=spec.dtype,
            identity=identity,
            max_model_len=int(model.max_model_len),
        )


def refuse_parallelism(vllm_config: VllmConfig) -> None:
    """Raise for the parallel layouts whose K/V a page cannot hold (yet)."""
    parallel = vllm_config.parallel_config
    sizes = {
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "decode_context_parallel_size": parallel.decode_context_parallel_size,
        "prefill_context_parallel_size": parallel.prefill_context_parallel_size,
    }
    wrong = {k: v for k, v in sizes.items() if v != 1}
    if wrong:
        raise ValueError(
            f"AsynchicacheConnector does not support {wrong}: a page holds every layer and "
            "every token of its positions, which these layouts split over ranks; run it "
            "with them 1 (tensor parallelism is supported)"
        )
