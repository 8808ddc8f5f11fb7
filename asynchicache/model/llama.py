"""The Llama-family decoder: Llama (1-3.x), Mistral, Qwen2, Qwen3, SmolLM.

The differences between those architectures are flags of `ModelConfig`
(biases, q/k norms, sliding windows, rotary scaling, tied embeddings). Q, K and
V are one fused projection and gate/up another, so a step issues few large
matmuls. Tokens of all sequences are flattened into one `[T, hidden]` batch;
attention goes through an `AttentionBackend` that knows the sequences and pages.

Weights arrive with Hugging Face names (`load_hf_weights`); GGUF tensors are
renamed to those names by `engine.models.gguf`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from asynchicache.model import gemm
from asynchicache.model.attention import AttentionBackend
from asynchicache.model.model_config import ModelConfig
from asynchicache.model.rotary import RotaryEmbedding
from asynchicache.model.row_ops import RowOps, rms_norm


class Linear(nn.Module):
    """y = x W^T (+ b). Parameters start uninitialised: a checkpoint always fills them.

    `prepack()` (after loading) gives the weight a copy in oneDNN's layout (`gemm`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None

    def prepack(self) -> bool:
        self.packed = gemm.pack(self.weight)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm.linear(x, self.weight, self.packed, self.bias)


class Embedding(nn.Module):
    """Token embeddings, uninitialised until loaded (like `Linear`)."""

    def __init__(self, num: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim]: normalized in float32 like the reference, scaled in x's dtype."""
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.split = (config.q_size, config.kv_size, config.kv_size)
        self.qkv_proj = Linear(config.hidden_size, sum(self.split), bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        ops: RowOps,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        t = x.shape[0]
        heads, kv_heads, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (heads + 2 kv_heads) hd]
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(t, heads, hd)  # [T, heads, hd]
        k = k.view(t, kv_heads, hd)  # [T, kv_heads, hd]
        v = v.view(t, kv_heads, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
            ops.rotary_(q, cos, sin)
            ops.rotary_(k, cos, sin)
        else:  # q and k side by side in qkv: rotate both in one pass
            ops.rotary_(
                qkv[:, : self.split[0] + self.split[1]].view(t, heads + kv_heads, hd), cos, sin
            )
        out = attn.attend(self.layer, q, k, v)  # [T, heads, hd]
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor, ops: RowOps) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))  # gate, up: [T, inter] each


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        ops: RowOps,
    ) -> torch.Tensor:
        """x [T, hidden], the residual stream, still without the previous layer's output
        `delta` (None for the first layer): both are added in place here, each addition
        in the same pass as the RMSNorm after it. Returns this layer's MLP output, the
        next layer's `delta`."""
        norm = self.input_layernorm
        if delta is None:
            h = ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h = ops.add_rms_norm(x, delta, norm.weight, norm.eps)
        attended = self.self_attn(h, cos, sin, attn, ops)
        norm = self.post_attention_layernorm
        return self.mlp(ops.add_rms_norm(x, attended, norm.weight, norm.eps), ops)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over flattened tokens; see the module docstring."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)
        self.lm_head = (
            None
            if config.tie_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.output_packed: torch.Tensor | None = None  # the LM head for `gemm`

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        logit_rows: torch.Tensor,
        ops: RowOps | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T]; logit_rows [n] rows whose logits to compute; `ops`
        the row-wise steps (torch's by default, the runner's native ones with its kernel).

        Returns float32 logits [n, vocab].
        """
        ops = ops or RowOps()
        x = self.embed_tokens(input_ids)  # [T, hidden]: a fresh tensor, added to in place
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # [T, 1, hd/2]
        delta = None
        for layer in self.layers:
            delta = layer(x, delta, cos, sin, attn, ops)
        x = x.index_select(0, logit_rows)  # [n, hidden]: the last layer's output added
        if delta is not None:  # to these rows alone
            x += delta.index_select(0, logit_rows)
        x = self.norm(x)
        return gemm.linear(x, self.output_weight, self.output_packed, None).float()  # [n, vocab]

    @property
    def output_weight(self) -> torch.Tensor:
        """[vocab, hidden] the LM head (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def load_hf_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (partly fused) parameters.

        Raises ValueError naming any weight the checkpoint lacks or has in the
        wrong shape; unknown extra tensors (e.g. rotary caches) are ignored.
        """
        loader = _WeightPlacer(self)
        for name, tensor in tensors:
            loader.place(name, tensor)
        loader.check_complete()
        self.prepack()

    def prepack(self) -> bool:
        """Reorder every linear weight for oneDNN where it applies (see `gemm`); whether it
        did. Call again after changing weights in place."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        packed = [m.prepack() for m in linears]
        self.output_packed = gemm.pack(self.output_weight)
        if all(packed) and self.output_packed is not None:
            return True
        for m in linears:  # one kind of kernel for every layer, or none
            m.packed = None
        self.output_packed = None
        return False


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class _WeightPlacer:
    """Tracks which parameter rows were filled, so a missing weight is an error."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.filled: set[tuple[str, int]] = set()

    def place(self, name: str, tensor: torch.Tensor) -> None:
        target, part = self._target(name)
        param = self.params.get(target)
        if param is None:
            return
        rows = self._rows(target, part)
        dest = param.data if rows is None else param.data[rows[0] : rows[1]]
        if dest.shape != tensor.shape:
            raise ValueError(
                f"weight {name}: checkpoint shape {tuple(tensor.shape)}, "
                f"model expects {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor)
        self.filled.add((target, part))

    def _target(self, name: str) -> tuple[str, int]:
        """HF name -> (our parameter name, part of a fused parameter or -1)."""
        name = name.removeprefix("model.") if not name.startswith("model.layers.") else name
        match = _LAYER_NAME.match(name)
        if match is None:
            return name, -1
        index, rest = match.groups()
        module, _, kind = rest.rpartition(".")
        if module in _FUSED:
            fused, part = _FUSED[module]
            return f"layers.{index}.{fused}.{kind}", part
        return f"layers.{index}.{rest}", -1

    def _rows(self, target: str, part: int) -> tuple[int, int] | None:
        if part < 0:
            return None
        config = self.model.config
        if "qkv_proj" in target:
            sizes = [config.q_size, config.kv_size, config.kv_size]
        else:
            sizes = [config.intermediate_size] * 2
        begin = sum(sizes[:part])
        return begin, begin + sizes[part]

    def check_complete(self) -> None:
        missing = [
            _hf_name(name, part)
            for name in self.params
            for part in _parts(name)
            if (name, part) not in self.filled
        ]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"checkpoint lacks {len(missing)} weights: {shown}")


def _parts(name: str) -> tuple[int, ...]:
    """The pieces a parameter is loaded in: q/k/v, gate/up, or whole (-1)."""
    if ".qkv_proj." in name:
        return (0, 1, 2)
    if ".gate_up_proj." in name:
        return (0, 1)
    return (-1,)


def _hf_name(name: str, part: int) -> str:
    """Our parameter name (and fused part) -> the Hugging Face weight name."""
    if part >= 0:
        for hf_module, (fused, index) in _FUSED.items():
            if index == part and f".{fused}." in name:
                name = name.replace(fused, hf_module)
                break
    return name if name.startswith("lm_head") else f"model.{name}"
